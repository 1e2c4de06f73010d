import json, math
import numpy as np
d = json.load(open("confidence_samples.json"))
keep = [i for i, c in enumerate(d["conf"]) if len(c) == 8]; C = np.array([d["conf"][i] for i in keep]); A = np.array([d["acc"][i] for i in keep])
n, K = C.shape
L = np.log(np.clip(C, 1e-6, 1 - 1e-6) / np.clip(1 - C, 1e-6, 1))
print("positions", K, "steps", n, "mean acc", A.mean())
temps, biases = [], []
for k in range(K):
    offered = A >= k          # the first k drafts accepted: position k+1 is tried
    hit = A >= k + 1
    x, y = L[offered, k], hit[offered].astype(float)
    pred = 1 / (1 + np.exp(-x))
    # Platt scaling a*x + b by Newton steps on the log-likelihood
    a, b = 1.0, 0.0
    for _ in range(50):
        p = 1 / (1 + np.exp(-(a * x + b)))
        g = np.array([((y - p) * x).sum(), (y - p).sum()])
        w = p * (1 - p)
        Hm = -np.array([[(w * x * x).sum(), (w * x).sum()], [(w * x).sum(), w.sum()]])
        step = np.linalg.solve(Hm, g)
        a, b = a - step[0], b - step[1]
    # temperature only
    T = 1.0
    best = None
    for t in np.exp(np.linspace(np.log(0.125), np.log(8), 97)):
        p = np.clip(1 / (1 + np.exp(-x / t)), 1e-9, 1 - 1e-9)
        ll = (y * np.log(p) + (1 - y) * np.log(1 - p)).sum()
        if best is None or ll > best: best, T = ll, t
    print(f"pos {k+1}: offered {offered.sum():4d} rate {y.mean():.3f} pred {pred.mean():.3f}  platt a={a:.2f} b={b:.2f} -> {(1/(1+np.exp(-(a*x+b)))).mean():.3f}  T={T:.2f} -> {(1/(1+np.exp(-x/T))).mean():.3f}")
