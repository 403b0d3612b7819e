"""Inventory of SGLang's speculative-decoding launch flags, read by hand from upstream and
typed in here as data; the tests check every flag trtspec writes for SGLang
(engines/exports.py) against it. A flag missing here is a trtspec bug, never a guess.

Source: sgl-project/sglang python/sglang/srt/server_args.py (ServerArgs, section "Speculative
decoding"; each flag is its field name with '-' for '_': speculative_eagle_topk ->
--speculative-eagle-topk), read at 001067fffe33427bee0ed2f007fb7551a1d76b44; the same names
at 469c63e54e7d94591617ef9590c6aa26d54dc1bb. Only the model-draft flags are inventoried
(partial: the ngram, DFLASH and DSPARK flags are not). Adaptive speculative decoding:
--speculative-adaptive (a bool field: a flag without a value) and --speculative-adaptive-config
(a path to a JSON file), server_args.py at 469c63e54e7d94591617ef9590c6aa26d54dc1bb; the file's
shape from python/sglang/srt/speculative/adaptive_spec_params.py@015c872628e328b530880bcf95ae91222604b225
(_load_adaptive_config: integer-string batch-size keys, each with candidate_steps, a non-empty
list of non-negative ints, and AdaptiveStepSlot's knobs).
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
        "--speculative-adaptive-config",
    }
)
BOOL_FLAGS = frozenset({"--speculative-adaptive"})  # store_true: no value follows
# One batch-size slot of --speculative-adaptive-config (AdaptiveStepSlot reads these).
ADAPTIVE_SLOT_KEYS = frozenset(
    {"candidate_steps", "ema_alpha", "update_interval", "warmup_batches", "down_hysteresis", "up_hysteresis", "ceiling_coeff"}
)
# speculative_algorithm's builtins (its help text): "EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, DFLASH, DSPARK"
ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK"})
INT_FLAGS = frozenset({"--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"})


def unknown_flags(argv: list[str]) -> list[str]:
    """Flags (and values) of ``--flag value`` pairs (and bare bool flags) that SGLang's
    inventory lacks."""
    argv = [a for a in argv if a not in BOOL_FLAGS]
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


def unknown_adaptive_config(cfg: dict) -> list[str]:
    """What --speculative-adaptive-config's loader would refuse or not read in ``cfg``."""
    out = []
    for key, slot in cfg.items():
        steps = slot.get("candidate_steps") if isinstance(slot, dict) else None
        if not key.isdigit() or not isinstance(steps, list) or not steps:
            out.append(f"{key}: not a batch-size slot with candidate_steps")
        elif not all(isinstance(s, int) and s >= 0 for s in steps):
            out.append(f"{key}.candidate_steps={steps}")
        else:
            out += [f"{key}.{k}" for k in slot if k not in ADAPTIVE_SLOT_KEYS]
    return out or ([] if cfg else ["no batch-size slot"])
