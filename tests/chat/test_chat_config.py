"""The parser flags (`--enable-auto-tool-choice`, `--tool-call-parser`, `--reasoning-parser`):
checked against the registries where they are parsed, read from the environment (compose),
passed by `pdmesh up` to every worker, reported in /v1/metadata; and the router's rule that
no raw first token is streamed ahead of a decode that parses the output."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import compose
import pytest
import yaml

from services.cli import build_parser
from services.commands.up import worker_flags
from services.common.stream_usage import StreamUsage
from services.router.first_token import FirstTokenSkipper, early_chunks
from services.router.legs import can_stream_first_token_early
from services.worker.config import WorkerConfig
from services.worker.parsers_config import ParsersConfig
from shared.protocol.pd import OUTPUT_PARSED_FIELD, ApiKind

ROOT = Path(__file__).resolve().parents[2]
PARSER_ENV = ("PDMESH_TOOL_CALL_PARSER", "PDMESH_ENABLE_AUTO_TOOL_CHOICE",
              "PDMESH_REASONING_PARSER")


def serve_config(*flags: str, env: dict[str, str] | None = None) -> WorkerConfig:
    args = build_parser().parse_args(["serve", *flags])
    return WorkerConfig.from_args(args, env or {})


def test_flags_and_environment() -> None:
    assert serve_config().parsers == ParsersConfig()
    flags = serve_config("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--reasoning-parser", "deepseek_r1").parsers
    assert flags == ParsersConfig("hermes", "deepseek_r1", True)
    env = {"PDMESH_TOOL_CALL_PARSER": "llama3_json", "PDMESH_ENABLE_AUTO_TOOL_CHOICE": "true",
           "PDMESH_REASONING_PARSER": ""}
    assert serve_config(env=env).parsers == ParsersConfig("llama3_json", None, True)
    assert serve_config("--tool-call-parser", "mistral", env=env).parsers.tool_call_parser == \
        "mistral"  # the flag wins


@pytest.mark.parametrize("command", ["serve", "up"])
@pytest.mark.parametrize("flag", ["--tool-call-parser", "--reasoning-parser"])
def test_an_unknown_name_is_refused_at_parse_time(command: str, flag: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, flag, "nope"])
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err
    assert ("hermes" in err) if flag == "--tool-call-parser" else ("qwen3" in err)


@pytest.mark.parametrize(("env", "needle"), [
    ({"PDMESH_TOOL_CALL_PARSER": "nope"}, "valid: channel, harmony, hermes"),
    ({"PDMESH_REASONING_PARSER": "nope"}, "valid: channel, deepseek_r1"),
    ({"PDMESH_ENABLE_AUTO_TOOL_CHOICE": "1"}, "requires --tool-call-parser"),
    ({"PDMESH_ENABLE_AUTO_TOOL_CHOICE": "maybe"}, "must be one of"),
    ({"PDMESH_REASONING_PARSER": "channel", "PDMESH_TOOL_CALL_PARSER": "hermes"},
     "frames the whole turn"),
])
def test_bad_settings_are_refused_with_the_valid_names(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        serve_config(env=env)


def test_up_passes_the_flags_to_every_worker() -> None:
    args = build_parser().parse_args(["up", "--enable-auto-tool-choice", "--tool-call-parser",
                                      "hermes", "--reasoning-parser", "qwen3"])
    for role in ("prefill", "decode", "mixed"):
        flags = worker_flags(role, args, 8101, 9101, 1)
        assert flags[-5:] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                              "--reasoning-parser", "qwen3"]
        parsed = build_parser().parse_args(["serve", *flags])
        assert WorkerConfig.from_args(parsed, {}).parsers == ParsersConfig("hermes", "qwen3", True)
    plain = build_parser().parse_args(["up"])
    assert not any("parser" in f for f in worker_flags("decode", plain, 8101, 9101, 1))


def test_compose_hands_the_parser_variables_to_every_worker() -> None:
    raw = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert set(PARSER_ENV) <= set(raw["x-worker"]["environment"])
    binary = Path(compose.__file__).with_name("docker-compose")
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PDMESH_TOOL_CALL_PARSER": "hermes",
           "PDMESH_ENABLE_AUTO_TOOL_CHOICE": "true"}
    proc = subprocess.run([str(binary), "-f", str(ROOT / "compose.yaml"), "--profile", "pp",
                           "config", "--format", "json"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    for name in ("prefill", "decode", "prefill-pp"):
        environment = services[name]["environment"]
        args = argparse.Namespace(tool_call_parser=None, reasoning_parser=None,
                                  enable_auto_tool_choice=None)
        parsers = ParsersConfig.from_args(args, {k: environment[k] for k in PARSER_ENV})
        assert parsers == ParsersConfig("hermes", None, True), name


PREFILL = {"id": "cmpl-1", "created": 1, "model": "m", "prompt_token_ids": [1, 2],
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "<"},
                        "token_ids": [60], "logprobs": None}]}


def test_router_streams_no_raw_first_token_ahead_of_a_parsing_decode() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    tool = {"type": "function", "function": {"name": "f"}}
    assert can_stream_first_token_early(body)
    assert not can_stream_first_token_early({**body, "tools": [tool]})
    assert not can_stream_first_token_early({**body, "tools": [tool], "tool_choice": "required"})
    assert can_stream_first_token_early({**body, "tools": [tool], "tool_choice": "none"})
    assert early_chunks(ApiKind.CHAT, PREFILL, StreamUsage())  # unparsed: early text
    parsed = {**PREFILL, OUTPUT_PARSED_FIELD: True}
    assert early_chunks(ApiKind.CHAT, parsed, StreamUsage()) == []
    skipper = FirstTokenSkipper(ApiKind.CHAT, parsed)
    assert skipper.done  # nothing went out early, so nothing is cut from the decode's stream
    chunk = {"prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert skipper.apply(json.loads(json.dumps(chunk))) == chunk
