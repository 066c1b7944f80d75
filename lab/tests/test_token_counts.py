"""One token-count parser (``512``, ``2k``, ``8k``, ``32k``, ``128k``) behind every flag of every command that
takes token counts; garbage is refused with the same message everywhere."""

from __future__ import annotations

import argparse

import pytest

from kvpolicy.cli import build_parser

#: every flag that takes token counts, by command (found by walking the parser; a new one must be listed)
TOKEN_FLAGS = {
    ("estimate", "--tokens"), ("ablate", "--context"), ("tune", "--context"), ("tune", "--tokens"),
    ("tune", "--screen-tokens"), ("tune", "--heldout-tokens"), ("analyze attention", "--context"),
    ("analyze rotation", "--context"), ("bench decode", "--lengths"), ("bench decode", "--context"),
    ("bench memory", "--lengths"), ("demo", "--max-new-tokens"), ("demo", "--context-tokens"),
    ("demo", "--continuation-tokens"),
}  # fmt: skip
TOKEN_TYPES = ("token_count", "prompt_length")


def _flags():
    def walk(parser, words=()):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            for name, sub in action.choices.items():
                yield from walk(sub, (*words, name))
        if not subs:
            for action in parser._actions:
                if action.option_strings:
                    yield " ".join(words), max(action.option_strings, key=len), action

    return list(walk(build_parser()))


def test_every_token_flag_uses_the_one_parser():
    typed = {(cmd, flag) for cmd, flag, action in _flags() if getattr(action.type, "__name__", "") in TOKEN_TYPES}
    assert typed == TOKEN_FLAGS
    # a flag named for tokens, contexts or lengths that is not parsed as token counts would be a second parser
    named = {(cmd, flag) for cmd, flag, _ in _flags() if flag.endswith(("-tokens", "--tokens", "--context",
                                                                        "--lengths"))}  # fmt: skip
    assert named <= TOKEN_FLAGS


@pytest.mark.parametrize(("text", "value"), [("512", 512), ("2k", 2048), ("8k", 8192), ("32K", 32768),
                                             ("128k", 131072), ("1m", 1 << 20)])  # fmt: skip
def test_token_counts_take_k_suffixes_everywhere(text, value):
    for cmd, flag, action in _flags():
        if (cmd, flag) in TOKEN_FLAGS and ((cmd, flag) == ("estimate", "--tokens") or value >= 8):
            assert action.type(text) == value, (cmd, flag)


@pytest.mark.parametrize("text", ["2kk", "abc", "2.5k", "-3", "k", "1e3", "", "99999999999999"])
def test_garbage_is_refused_with_one_message_everywhere(text):
    for cmd, flag, action in _flags():
        if (cmd, flag) in TOKEN_FLAGS:
            with pytest.raises(argparse.ArgumentTypeError, match=r"must be a token count (such as 512, 2k, 8k or "
                               r"128k \(k = 1024\)|from \d+ to \d+); got"):  # fmt: skip
                action.type(text)


def test_ablate_context_keeps_its_minimum():
    (action,) = [a for cmd, flag, a in _flags() if (cmd, flag) == ("ablate", "--context")]
    with pytest.raises(argparse.ArgumentTypeError, match="must be a token count from 8 to"):
        action.type("4")
    assert action.type("4k") == 4096
