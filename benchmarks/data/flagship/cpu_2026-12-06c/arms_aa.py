"""A/A control: two arms that are the same engine."""
import contextlib


def arms(llm):
    return {"a": contextlib.nullcontext, "b": contextlib.nullcontext}
