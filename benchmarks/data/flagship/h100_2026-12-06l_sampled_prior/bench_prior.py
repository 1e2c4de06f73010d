"""`blockspec bench ARGS` with the policy told which requests sample (the engine's default: "on") or not ("off": the
recorded greedy acceptance weighs every request, as before 2026-12-06): python bench_prior.py on|off ARGS..."""
import sys

from blockspec.cli import main
from blockspec.speculative.policy import DraftLengthPolicy

if sys.argv[1] == "off":
    told = DraftLengthPolicy.observe_acceptance
    DraftLengthPolicy.observe_acceptance = lambda self, lens, accepted, sampled=None: told(self, lens, accepted)
sys.exit(main(["bench", *sys.argv[2:]]))
