"""Eager appends of the held buffer's whole width (before 7723a39) against only the rows held (shipped)."""
import contextlib
import types

from cpu_ab import swapped


def arms(llm):
    g = llm.engine.proposer.graphs
    shipped = type(g)._append
    return {"all_rows": lambda: swapped([(g, "_append", types.MethodType(
                lambda self, control, rows=None: shipped(self, control, None), g))]),
            "held_rows": contextlib.nullcontext}
