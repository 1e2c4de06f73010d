"""The corpus pipeline on a tiny corpus of sdists made here (offline: every archive is a local file):
download checks, filters, held-out hygiene, dedup, pieces and the manifest's determinism."""

from __future__ import annotations

import hashlib
import io
import json
import random
import string
import sysconfig
import tarfile
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from blockspec.train.corpus import (
    BuildSettings,
    CorpusError,
    build,
    check,
    content_key,
    load_piece,
    load_pins,
    load_split,
    main,
)

PIECE_CAP = 2048


def module_text(name: str, functions: int) -> str:
    """A distinct module of plausible functions with seeded random names and constants (poorly compressible)."""
    rng = random.Random(name)

    def word() -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))

    return "".join(f"def {name}_{word()}({word()}, {word()}={rng.randint(0, 999)}):\n"
                   f"    \"\"\"Return {word()} {word()} of the {word()}.\"\"\"\n"
                   f"    return {word()}.{word()}({rng.randint(0, 99999)}) + len('{word()}')\n\n"
                   for _ in range(functions))


CORE = module_text("core", 40)
UTIL = module_text("util", 30)
SHARED = module_text("shared", 20)
CONTROL = module_text("control", 25)
VALID = module_text("valid", 15)
STDLIB_TRAIN = module_text("stdmod", 20)


def near_copy_of_json_decoder() -> str:
    """The stdlib's json/decoder.py as a project would vendor it: a header, a renamed class, one line changed,
    re-indented by two spaces."""
    original = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    return "# vendored from the standard library\n" + original.replace("JSONDecoder", "FastDecoder").replace(
        "NaN = float('nan')", "NaN = float(\"nan\")").replace("    ", "  ")


def make_sdist(directory: Path, name: str, version: str, files: dict[str, str | bytes]) -> Path:
    """A tar.gz laid out like an sdist (everything under NAME-VERSION/)."""
    path = directory / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, content in sorted(files.items()):
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(f"{name}-{version}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_pin_file(path: Path, archives: dict[tuple[str, str], Path], validation: list[str],
                   sha_override: dict[str, str] | None = None) -> Path:
    """A pin file beside the archives (their urls are paths relative to it)."""
    sources = []
    for (name, version), archive in archives.items():
        sha = (sha_override or {}).get(name) or hashlib.sha256(archive.read_bytes()).hexdigest()
        sources.append({"name": name, "version": version, "filename": archive.name, "url": archive.name,
                        "sha256": sha, "license": "MIT"})
    path.write_text(json.dumps({"validation": validation, "sources": sources}))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Sources, a stand-in stdlib holding the real json package, and one build of them."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = root / "stdlib"
    real_json = Path(sysconfig.get_paths()["stdlib"]) / "json"
    (stdlib / "json").mkdir(parents=True)
    for name in ("__init__.py", "decoder.py"):
        (stdlib / "json" / name).write_text((real_json / name).read_text())
    (stdlib / "stdmod.py").write_text(STDLIB_TRAIN)
    sources = root / "sources"
    sources.mkdir()
    archives = {
        ("alpha", "1.0"): make_sdist(sources, "alpha", "1.0", {
            "alpha/core.py": CORE, "alpha/util.py": UTIL,
            "alpha/dup.py": SHARED,
            "alpha/table.py": "DATA = [" + ", ".join(str(i) for i in range(400)) + "]\n",
            "alpha/latin1.py": "NAME = 'caf\xe9'\n".encode("latin-1"),
            "alpha/README.txt": "not python\n"}),
        ("beta", "2.0"): make_sdist(sources, "beta", "2.0", {
            "beta/shared.py": SHARED.replace("    ", "\t").replace("\n\n", "\n\n\n"),
            "beta/jsondecoder.py": near_copy_of_json_decoder(),
            "beta/control.py": CONTROL}),
        ("gamma", "0.1"): make_sdist(sources, "gamma", "0.1", {"gamma/valid.py": VALID}),
    }
    pins = write_pin_file(sources / "sources.json", archives, ["gamma"])
    settings = BuildSettings(vocab_size=400, max_piece_bytes=PIECE_CAP)
    out = root / "out"
    manifest = build(load_pins(pins), out, settings, cache=root / "cache", stdlib_root=stdlib, log=lambda _: None)
    return {"root": root, "stdlib": stdlib, "sources": sources, "archives": archives, "pins": pins,
            "settings": settings, "out": out, "manifest": manifest}


def archive_report(manifest: dict, name: str) -> dict:
    return next(a for a in manifest["archives"] if a["name"] == name)


def test_sha256_mismatch_names_the_package(corpus, tmp_path, capsys):
    pins = write_pin_file(corpus["sources"] / "bad_sha.json", corpus["archives"], ["gamma"],
                          sha_override={"beta": "0" * 64})
    code = main(["build", "--sources", str(pins), "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"),
                 "--stdlib-root", str(corpus["stdlib"]), "--vocab-size", "400"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: beta 2.0: sha256 of beta-2.0.tar.gz is ") and err.endswith("0" * 64)
    assert "\n" not in err
    assert not (tmp_path / "cache" / "beta-2.0.tar.gz").exists()  # a bad download is not kept
    assert (tmp_path / "cache" / "alpha-1.0.tar.gz").is_file()


def test_filters_skip_generated_and_undecodable_files(corpus):
    alpha = archive_report(corpus["manifest"], "alpha")
    assert alpha["py_files"] == 5
    assert alpha["skipped"] == {"long_lines": 1, "not_utf8": 1}


def test_exact_dedup_keeps_the_first_copy(corpus):
    m = corpus["manifest"]
    assert m["dedup"]["duplicates_dropped"] == 1
    assert m["dedup"]["files_before"] == m["dedup"]["files_after"] + 1
    assert archive_report(m, "beta")["duplicates"] == 1
    assert archive_report(m, "alpha")["files_kept"] == 3  # core, util, dup


def test_near_copy_of_heldout_json_is_dropped_and_control_kept(corpus):
    m = corpus["manifest"]
    assert m["heldout"]["near_copies_dropped"] == 1
    (dropped,) = m["heldout"]["near_copies"]
    assert (dropped["source"], dropped["path"]) == ("beta", "beta/jsondecoder.py")
    assert dropped["share"] >= 0.5
    beta = archive_report(m, "beta")
    assert (beta["near_copies"], beta["files_kept"]) == (1, 1)  # control.py
    assert m["stdlib"]["heldout_files"] == 2 and m["stdlib"]["train_files"] == 1


def test_pieces_round_trip_with_identical_tokens(corpus):
    m, out = corpus["manifest"], corpus["out"]
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    train_texts = sorted([STDLIB_TRAIN, CORE, UTIL, SHARED, CONTROL], key=content_key)
    for split, texts in (("train", train_texts), ("validation", [VALID])):
        expected = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False).ids + [eos]]
        tokens = load_split(out / "pieces", split)
        assert tokens.dtype == np.uint16
        assert tokens.tolist() == expected
        assert m["splits"][split]["tokens"] == len(expected)
        assert m["splits"][split]["files"] == len(texts)
    assert check(out) == {"train": m["splits"]["train"]["tokens"], "validation": m["splits"]["validation"]["tokens"]}
    pieces = m["splits"]["train"]["pieces"]
    assert len(pieces) >= 2
    for piece in pieces:
        assert (out / "pieces" / piece["file"]).stat().st_size == piece["bytes"] <= PIECE_CAP
        tokens = load_piece(out / "pieces" / piece["file"])
        assert tokens[-1] == eos or eos not in tokens  # a piece ends after a file unless one file outgrows it


def test_corrupt_piece_is_refused(corpus, tmp_path):
    piece = corpus["out"] / "pieces" / corpus["manifest"]["splits"]["train"]["pieces"][0]["file"]
    copy = tmp_path / piece.name
    blob = bytearray(piece.read_bytes())
    blob[len(blob) // 2] ^= 1
    copy.write_bytes(bytes(blob))
    (tmp_path / piece.name.replace(".u16.xz", ".json")).write_bytes(
        piece.with_name(piece.name.replace(".u16.xz", ".json")).read_bytes())
    with pytest.raises(CorpusError, match=f"{piece.name}: sha256 does not match"):
        load_piece(copy)


def test_second_build_from_cache_is_identical(corpus):
    archives = corpus["archives"]
    moved = {path: path.with_suffix(".away") for path in archives.values()}
    for path, away in moved.items():  # the second build must take every archive from the cache
        path.rename(away)
    try:
        out2 = corpus["root"] / "out2"
        build(load_pins(corpus["pins"]), out2, corpus["settings"], cache=corpus["root"] / "cache",
              stdlib_root=corpus["stdlib"], log=lambda _: None)
    finally:
        for path, away in moved.items():
            away.rename(path)
    out1 = corpus["out"]
    assert (out2 / "manifest.json").read_bytes() == (out1 / "manifest.json").read_bytes()
    assert (out2 / "tokenizer" / "tokenizer.json").read_bytes() == (out1 / "tokenizer" / "tokenizer.json").read_bytes()
    names = sorted(p.name for p in (out1 / "pieces").iterdir())
    assert names == sorted(p.name for p in (out2 / "pieces").iterdir())
    for name in names:
        assert (out2 / "pieces" / name).read_bytes() == (out1 / "pieces" / name).read_bytes()


def test_projects_copying_heldout_packages_are_refused(tmp_path):
    pins = tmp_path / "sources.json"
    pins.write_text(json.dumps({"sources": [{"name": "simplejson", "version": "3.19.3", "filename": "s.tar.gz",
                                             "url": "s.tar.gz", "sha256": "0" * 64, "license": "MIT"}]}))
    with pytest.raises(CorpusError, match=r"sources\[0\]: simplejson copies a held-out stdlib package"):
        load_pins(pins)
