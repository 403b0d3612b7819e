"""Inventory of SGLang's speculative-decoding launch flags, read by hand from upstream and
typed in here as data; the tests check every flag trtspec writes for SGLang
(engines/exports.py) against it. A flag missing here is a trtspec bug, never a guess.

Source: sgl-project/sglang python/sglang/srt/server_args.py (ServerArgs, section "Speculative
decoding"; each flag is its field name with '-' for '_': speculative_eagle_topk ->
--speculative-eagle-topk), read at 001067fffe33427bee0ed2f007fb7551a1d76b44; the same names
at 469c63e54e7d94591617ef9590c6aa26d54dc1bb. Only the model-draft flags are inventoried
(partial: the ngram, DFLASH and DSPARK flags are not).
"""

from __future__ import annotations

SOURCE = "sgl-project/sglang python/sglang/srt/server_args.py@001067fffe33427bee0ed2f007fb7551a1d76b44"

FLAGS = frozenset(
    {
        "--speculative-algorithm",
        "--speculative-draft-model-path",
        "--speculative-draft-model",  # alias of --speculative-draft-model-path
        "--speculative-draft-model-revision",
        "--speculative-draft-load-format",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--speculative-accept-threshold-single",
        "--speculative-accept-threshold-acc",
        "--speculative-token-map",
        "--speculative-attention-mode",
        "--speculative-draft-attention-backend",
    }
)
# speculative_algorithm's builtins (its help text): "EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, DFLASH, DSPARK"
ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK"})
INT_FLAGS = frozenset({"--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"})


def unknown_flags(argv: list[str]) -> list[str]:
    """Flags (and values) of ``--flag value`` pairs that SGLang's inventory lacks."""
    if len(argv) % 2:
        return [f"odd argv: {argv}"]
    out = []
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag not in FLAGS:
            out.append(flag)
        elif flag == "--speculative-algorithm" and value not in ALGORITHMS:
            out.append(f"{flag}={value}")
        elif flag in INT_FLAGS and not value.isdigit():
            out.append(f"{flag}={value}")
    return out
