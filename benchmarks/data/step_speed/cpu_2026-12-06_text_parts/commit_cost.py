import time
from transformers import AutoTokenizer
from blockspec.assets import PAIR
from blockspec.engine.output import OutputProcessor
from blockspec.request import IncrementalDetokenizer, Request
from blockspec.sampling_params import SamplingParams
tok = AutoTokenizer.from_pretrained(str(PAIR / "target"))
import json, pathlib
text = "".join(p.read_text() for p in sorted(pathlib.Path(json.__file__).parent.parent.joinpath("email").glob("*.py")))
ids = tok(text)["input_ids"]
print(len(ids))
out = OutputProcessor([tok.eos_token_id], 1 << 30)
p = SamplingParams(temperature=0, max_tokens=1 << 30)
r = Request("r", None, ids[:32], p, 0)
r.detok = IncrementalDetokenizer(tok, list(ids[:32]), True)
body = ids[32:32 + 64000]
marks = []
t0 = time.perf_counter()
for i in range(0, len(body), 4):
    out.commit(r, body[i:i + 4], None)
    if (i // 4) % 2000 == 1999:
        t1 = time.perf_counter(); marks.append(round((t1 - t0) / 8000 * 1e6, 2)); t0 = t1
print("us a token per 8000 tokens:", marks, "text chars", len(r.detok.text))
