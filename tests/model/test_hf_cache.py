"""`--model org/name` from the local Hugging Face hub cache, offline.

The fake caches below have huggingface_hub's real layout: models--{org}--{name}/refs/<ref>
holding a commit hash, snapshots/<commit>/<file> relative links into blobs/<sha256>. Where
huggingface_hub is installed (transformers brings it), its own offline `snapshot_download`
must find the same directory in the same cache.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared.config import EngineConfig, hf_hub_cache_from_env
from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.registry import ModelNotFoundError, hub_repo_dir, resolve_model

REPO = "acme/tiny-llama"
MAIN = "a" * 40
V1 = "b" * 40
HUB_ENVS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def fill(hub: Path, repo_id: str, commit: str, files: Path, refs: tuple[str, ...] = ()) -> Path:
    """Put the files of directory `files` into `hub` as commit `commit` of `repo_id`, as
    huggingface_hub downloads them, and point each ref at it."""
    repo = hub_repo_dir(repo_id, hub)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(files.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, make_checkpoint: Callable[..., Path]) -> Path:
    """A hub cache with REPO at main (seed 0) and at branch dev and tag v1 (seed 1)."""
    hub = tmp_path / "hub"
    fill(hub, REPO, MAIN, make_checkpoint(preset="tiny", seed=0), refs=("main",))
    fill(hub, REPO, V1, make_checkpoint(preset="tiny", seed=1), refs=("dev", "v1"))
    return hub


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in HUB_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_default_revision_is_main(hub: Path) -> None:
    assert resolve_model(REPO, hub_cache=hub) == hub_repo_dir(REPO, hub) / "snapshots" / MAIN
    assert resolve_model(f" {REPO} ", hub_cache=hub, revision="main").name == MAIN


def test_branch_tag_and_commit_hash_revisions(hub: Path) -> None:
    snapshots = hub / "models--acme--tiny-llama" / "snapshots"
    assert resolve_model(REPO, hub_cache=hub, revision="dev") == snapshots / V1
    assert resolve_model(REPO, hub_cache=hub, revision="v1") == snapshots / V1
    # A full commit hash names its snapshot directly, with or without a ref pointing at it.
    assert resolve_model(REPO, hub_cache=hub, revision=V1) == snapshots / V1
    (hub / "models--acme--tiny-llama" / "refs" / "v1").unlink()
    (hub / "models--acme--tiny-llama" / "refs" / "dev").unlink()
    assert resolve_model(REPO, hub_cache=hub, revision=V1) == snapshots / V1


def test_a_missing_model_names_the_path_and_how_to_fill_it(tmp_path: Path) -> None:
    hub = tmp_path / "empty-hub"
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("acme/absent", hub_cache=hub, revision="v2")
    text = str(err.value)
    assert str(hub / "models--acme--absent") in text
    assert "hf download acme/absent --revision v2" in text
    assert "HF_HUB_CACHE" in text and "never downloads" in text


def test_an_unknown_revision_names_the_revisions_present(hub: Path) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(REPO, hub_cache=hub, revision="v2")
    text = str(err.value)
    assert str(hub_repo_dir(REPO, hub) / "refs" / "v2") in text
    assert "refs present: dev, main, v1" in text and f"{MAIN}, {V1}" in text
    # huggingface_hub offline: an abbreviated hash is not a revision; nor is a path escape.
    for revision in (V1[:7], "../../x", "c" * 40):
        with pytest.raises(ModelNotFoundError, match="refs present"):
            resolve_model(REPO, hub_cache=hub, revision=revision)


def test_a_ref_without_its_snapshot_or_a_snapshot_without_config_is_refused(
        hub: Path) -> None:
    repo = hub_repo_dir(REPO, hub)
    (repo / "refs" / "main").write_text("c" * 40)
    with pytest.raises(ModelNotFoundError, match=f"refs/main names commit {'c' * 40}, but"):
        resolve_model(REPO, hub_cache=hub)
    (repo / "refs" / "main").write_text("not a hash")
    with pytest.raises(ModelNotFoundError, match="not a commit hash"):
        resolve_model(REPO, hub_cache=hub)
    (repo / "snapshots" / V1 / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no config.json") as err:
        resolve_model(REPO, hub_cache=hub, revision="v1")
    assert str(repo / "snapshots" / V1) in str(err.value)


def test_a_refs_main_is_needed_even_for_a_lone_snapshot(
        tmp_path: Path, make_checkpoint: Callable[..., Path]) -> None:
    """As huggingface_hub offline: no ref, no revision; the error lists the snapshot."""
    hub = tmp_path / "hub"
    fill(hub, REPO, MAIN, make_checkpoint(preset="tiny", seed=0))
    with pytest.raises(ModelNotFoundError, match=f"refs present: none; snapshots present: {MAIN}"):
        resolve_model(REPO, hub_cache=hub)


def test_a_local_directory_wins_over_a_hub_name(
        hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        make_checkpoint: Callable[..., Path]) -> None:
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "acme" / "tiny-llama"
    shutil.copytree(make_checkpoint(preset="tiny", seed=0), local)
    assert resolve_model(REPO, hub_cache=hub) == Path(REPO)
    with pytest.raises(ModelNotFoundError, match="is a local directory"):
        resolve_model(REPO, hub_cache=hub, revision="v1")


def test_other_names_keep_their_meaning(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model", hub_cache=tmp_path)
    with pytest.raises(ModelNotFoundError, match="embedded model"):
        resolve_model("smollm2-135m-instruct", hub_cache=tmp_path, revision="main")
    for not_a_repo_id in ("./acme/x", "/abs/acme", "a/b/c", "acme--x/y", "acme/../y"):
        with pytest.raises(ModelNotFoundError, match="unknown model"):
            resolve_model(not_a_repo_id, hub_cache=tmp_path)


def test_hub_cache_precedence_follows_huggingface_hub(
        clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert hf_hub_cache_from_env() == home / ".cache" / "huggingface" / "hub"
    assert EngineConfig().hf_hub_cache == home / ".cache" / "huggingface" / "hub"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert EngineConfig().hf_hub_cache == tmp_path / "xdg" / "huggingface" / "hub"
    clean_env.setenv("HF_HOME", "~/hf")
    assert EngineConfig().hf_hub_cache == home / "hf" / "hub"
    clean_env.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert EngineConfig().hf_hub_cache == tmp_path / "legacy"
    clean_env.setenv("HF_HUB_CACHE", "$XDG_CACHE_HOME/hub")
    assert EngineConfig().hf_hub_cache == tmp_path / "xdg" / "hub"
    clean_env.setenv("HF_HUB_CACHE", "")  # empty: unset
    assert EngineConfig().hf_hub_cache == tmp_path / "legacy"
    # An explicit mapping, as WorkerConfig.from_args hands it, and a value given outright.
    assert hf_hub_cache_from_env({"HF_HOME": "/h"}) == Path("/h/hub")
    assert EngineConfig(hf_hub_cache=tmp_path).hf_hub_cache == tmp_path
    with pytest.raises(ValueError, match="revision"):
        EngineConfig(revision=" ")


def test_the_engine_loads_the_revision_from_the_hub_cache(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    """EngineConfig(model=org/name, revision, hf_hub_cache) -> the engine runs that snapshot."""
    from shared.engine.engine import LLMEngine
    from shared.engine.sampling_params import SamplingParams
    from shared.model.loader import open_checkpoint

    hub = tmp_path / "hub"
    seed0 = write_checkpoint(tmp_path / "seed0", ModelSpec(seed=0), tokenizer_dir)
    seed1 = write_checkpoint(tmp_path / "seed1", ModelSpec(seed=1), tokenizer_dir)
    fill(hub, REPO, MAIN, seed0, refs=("main",))
    fill(hub, REPO, V1, seed1, refs=("v1",))
    engine = LLMEngine.from_config(EngineConfig(
        model=REPO, revision="v1", hf_hub_cache=hub, num_threads=1,
        kv_cache_memory_bytes=8 << 20))
    assert engine.model_dir == hub_repo_dir(REPO, hub) / "snapshots" / V1
    assert engine.fingerprint == open_checkpoint(seed1).fingerprint()
    assert engine.fingerprint != open_checkpoint(seed0).fingerprint()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[-1].token_ids) == 4


def test_worker_and_up_flags_carry_the_revision(tmp_path: Path) -> None:
    from services.commands import serve, up
    from services.worker.config import WorkerConfig

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--model", REPO, "--revision", "v1"])
    flags = up.worker_flags("decode", args, 8102, 9102, 1)
    assert flags[flags.index("--revision") + 1] == "v1"
    worker = argparse.ArgumentParser()
    serve.add_arguments(worker)
    config = WorkerConfig.from_args(worker.parse_args(flags), {"HF_HUB_CACHE": str(tmp_path)})
    assert (config.engine.model, config.engine.revision) == (REPO, "v1")
    assert config.engine.hf_hub_cache == tmp_path
    assert "--revision" not in up.worker_flags("decode", parser.parse_args([]), 8102, 9102, 1)


def test_doctor_reads_the_revision_from_the_hub_cache(
        hub: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    monkeypatch.delenv("PDMESH_TORCH_VARIANT", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))

    def arch_row(*flags: str) -> str:
        main(["doctor", "--skip-components", *flags])
        out = capsys.readouterr().out
        return next(line for line in out.splitlines() if line.startswith("model arch"))

    assert "LlamaForCausalLM" in arch_row("--model", REPO, "--revision", "v1")
    row = arch_row("--model", REPO, "--revision", "v2")
    assert "REFUSED" in row and "refs present: dev, main, v1" in row, row


@pytest.fixture
def hf() -> Any:
    return pytest.importorskip("huggingface_hub")


@pytest.mark.parametrize("revision", ["main", "dev", "v1", MAIN, V1])
def test_same_snapshot_as_huggingface_hub_offline(hub: Path, hf: Any, revision: str) -> None:
    theirs = hf.snapshot_download(REPO, revision=revision, cache_dir=hub, local_files_only=True)
    assert resolve_model(REPO, hub_cache=hub, revision=revision) == Path(theirs)


@pytest.mark.parametrize("revision", ["v2", V1[:7], "c" * 40])
def test_both_refuse_what_huggingface_hub_offline_refuses(
        hub: Path, hf: Any, revision: str) -> None:
    with pytest.raises(hf.errors.LocalEntryNotFoundError):
        hf.snapshot_download(REPO, revision=revision, cache_dir=hub, local_files_only=True)
    with pytest.raises(ModelNotFoundError):
        resolve_model(REPO, hub_cache=hub, revision=revision)
