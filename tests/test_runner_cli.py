"""``python -m model_runner`` failing well: prompts the model cannot take are one-line errors before it loads (or
truncated when asked), and Ctrl-C ends a command with one line and exit status 130."""
import json
import re

import pytest

import model_runner.__main__ as cli
from model_runner.__main__ import main
from model_runner.engine import Engine

POSITIONS = 32  # max_position_embeddings of the test checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny checkpoint (vocabulary 258) of ``POSITIONS`` positions."""
    folder = tmp_path_factory.mktemp("tiny_cli")
    assert main(["make-tiny", str(folder)]) == 0
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": POSITIONS}))
    return folder


def generate(folder, tmp_path, lines, *extra):
    """Exit status and result lines (None unless it succeeded) of ``generate`` over ``lines``."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code = main(["generate", "--model", str(folder), "--prompts", str(prompts), "--out", str(out), "--mode",
                 "reference", "--max-new-tokens", "4", "--no-progress", "--ignore-eos", *extra])
    return code, [json.loads(line) for line in out.read_text().splitlines()] if code == 0 else None


def no_model(*args, **kwargs):
    pytest.fail("the model loaded")


@pytest.mark.parametrize("lines, extra, message", [
    ([[1] * 5, [2] * 29], (), rf"line 2: 29 tokens \+ 4 new tokens exceed max_position_embeddings {POSITIONS} of the "
                              r"model \(--truncate left keeps the last 28\)$"),
    ([[1], [1, 258]], (), r"line 2: token 1 is 258, not an id in \[0, 258\) \(the vocabulary\)$"),
    ([[1, 2], [-1]], (), r"line 2: token 0 is -1, not an id"),
    ([{"prompt": "x" * 40}], (), r"line 1: 41 tokens \+ 4 new tokens exceed"),  # text: BOS + one token a byte
    ([[1]], ("--max-new-tokens", "32", "--truncate", "left"), "line 1: 32 new tokens leave no room for the prompt"),
])
def test_prompts_are_checked_before_the_model_loads(tiny, tmp_path, capsys, monkeypatch, lines, extra, message):
    monkeypatch.setattr(cli, "build_engine", no_model)
    code, _ = generate(tiny, tmp_path, lines, *extra)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("error: ")
    assert re.search(message, err), err


def test_truncate_left_keeps_the_last_tokens(tiny, tmp_path, capsys):
    long, short = list(range(2, 42)), [7, 8, 9]  # 40 + 4 tokens do not fit 32 positions
    code, results = generate(tiny, tmp_path, [long, short], "--truncate", "left")
    assert code == 0 and "note: --truncate left: 1 of 2 prompts keep only their last tokens" in capsys.readouterr().out
    code, kept = generate(tiny, tmp_path, [long[-28:], short])
    assert code == 0 and results == kept and results[0]["prompt_tokens"] == 28
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--truncate {left}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "make-tiny"])
def test_ctrl_c_is_one_line(tiny, tmp_path, capsys, monkeypatch, command):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if command == "generate":
        monkeypatch.setattr(Engine, "step", interrupt)  # the model loaded, generating
        run = lambda: generate(tiny, tmp_path, [[5, 6, 7]])[0]  # noqa: E731
    else:
        monkeypatch.setattr(cli, "make_tiny", interrupt)
        run = lambda: main(["make-tiny", str(tmp_path / "tiny")])  # noqa: E731
    try:
        code = run()
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left main as a KeyboardInterrupt (a traceback)")
    assert code == 130 and capsys.readouterr().err == "interrupted\n"
    assert not (tmp_path / "out.jsonl").exists()
