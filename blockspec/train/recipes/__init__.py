"""Reproducible end-to-end training recipes (`python -m blockspec.train.recipes.<name>`)."""
