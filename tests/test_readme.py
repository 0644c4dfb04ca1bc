"""The README's examples, run as written against a server started the way `make run` starts it (the same
defaults, the shipped demo adapters), on a free port instead of 8000."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
from pathlib import Path

import pytest

from tests.server.conftest import LiveServer
from vlora.cli import build_parser, serving_engine

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)


def block(lang: str, contains: str) -> str:
    found = [body for kind, body in BLOCKS if kind == lang and contains in body]
    assert len(found) == 1, f"README: expected one {lang} block with {contains!r}, found {len(found)}"
    return found[0]


def block_after(lang: str, contains: str) -> str:
    """The block that follows the one with ``contains`` (the README shows a command's output below it)."""
    i = next(i for i, (kind, body) in enumerate(BLOCKS) if kind == lang and contains in body)
    return BLOCKS[i + 1][1]


@pytest.fixture(scope="module")
def make_run():
    """`vlora serve` with no flags (make run): the embedded model and the shipped demo adapters."""
    args = build_parser().parse_args(["serve", "--port", "0"])
    engine, config, _ = serving_engine(args)
    server = LiveServer(engine, config)
    yield server
    server.stop()


def local(code: str, server: LiveServer) -> str:
    return code.replace("http://127.0.0.1:8000", server.url)


def test_curl_example(make_run):
    command = block("bash", "curl ")
    out = subprocess.run(["bash", "-c", local(command, make_run)], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.strip() == block_after("bash", "curl ").strip()


def test_openai_example(make_run):
    code = block("python", "from openai import OpenAI")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(local(code, make_run), "README.md", "exec"), {})
    want = block_after("python", "from openai import OpenAI").strip().splitlines()
    got = stdout.getvalue().splitlines()
    assert got[:len(want) - 1] == want[:-1]                   # the models, then the adapter's answer
    assert want[-1] == "..." and len("".join(got[len(want) - 1:])) > 0   # the streamed story, whatever it says


def test_python_api_example():
    code = block("python", "from vlora import LLM")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, "README.md", "exec"), {})
    want = block_after("python", "from vlora import LLM").strip().splitlines()
    got = stdout.getvalue().splitlines()
    assert got[:len(want) - 1] == want[:-1] and want[-1] == "..."
