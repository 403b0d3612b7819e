"""`trtspec distill SPEC`: train an EAGLE-3 head for the spec's target."""

from __future__ import annotations

from trtspec.cli.common import AllowPickleOpt, DeviceOpt, JsonFileOpt, JsonOpt, SpecArg, handle_errors, with_device
from trtspec.cli.options import declared
from trtspec.cli.output import emit
from trtspec.distill.options import DistillOptions
from trtspec.spec import load_spec


@handle_errors
@declared(DistillOptions)
def distill(
    spec: SpecArg,
    opts: DistillOptions,
    allow_pickle: AllowPickleOpt = False,
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
) -> None:
    """Train an EAGLE-3 head for SPEC's target and write it at the spec's draft.path.

    Data are the target's own responses to the prompts (10% held out, never trained on),
    captured as they are generated, plus --corpus conversations. The spec's verify prompts
    are never trained on: distill scores the head on them per draft position, measures its
    costs and recommends default_draft_tokens. The recipe is the spec's distill: block, if it
    has one; a recipe flag given here overrides its key (none clears --time-budget, --scaling,
    --layers). Ctrl-C keeps the last good checkpoint; --resume finishes the run exactly as if
    uninterrupted, under the same recipe. Exit 2 on bad input (existing output without --force,
    empty prompts, a corpus in another format, a work folder in use, a changed recipe on --resume).

    Examples:
      trtspec distill engine_specs/smollm2-135m-eagle3.yaml
      trtspec distill engine_specs/smollm2-135m-eagle3.yaml --time-budget 25m
      trtspec distill engine_specs/smollm2-135m-eagle3.yaml --corpus chats.jsonl \\
        --max-steps 3000
      trtspec distill engine_specs/tiny-llama-eagle3.yaml --max-steps 200 --force
      trtspec distill my-8b-eagle3.yaml --device cuda --time-budget 2h  # a GPU
      trtspec distill my.yaml --from-capture captured --init heads/v1 \\
        -o heads/v2 --max-steps 300

    With --from-capture DIR --init HEAD: continue HEAD on the requests serve.capture kept in DIR
    (docs/capture.md), --replay of the training sequences from HEAD's original data; the newest
    --capture-held-out of the captured requests are never trained on, and both heads are scored
    side by side on them and on the spec's verify prompts (acceptance at k=1).
    """
    from trtspec.distill.refine import refine
    from trtspec.distill.run import distill as run

    loaded = with_device(load_spec(spec), device)
    opts = opts.model_copy(update={"allow_pickle": allow_pickle})
    result = refine(loaded, opts) if opts.from_capture or opts.init else run(loaded, opts)
    emit(result, lambda out: out.print(result.summary()), as_json=as_json, json_file=json_file)
