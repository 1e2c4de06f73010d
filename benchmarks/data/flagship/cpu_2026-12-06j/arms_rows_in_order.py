"""Sample-and-match on the CPU: each request's rows sampled in position order while its drafts match (the tree)
against every verify row sampled, as before; every step drafting the whole block, as the demo does."""
from cpu_ab import swapped

from blockspec.sample import verify as verify_mod
from blockspec.sample.sampler import sample_processed


def every_row(target, drafts, lens, params):
    r, k1, vocab = target.shape
    return sample_processed(target.reshape(r * k1, vocab), params).view(r, k1)


def arms(llm):
    llm.engine.policy.adaptive = False  # every step drafts the whole block, as `blockspec demo` does
    return {"in_order": lambda: swapped([]),
            "every_row": lambda: swapped([(verify_mod, "_sampled_while_matching", every_row)])}
