"""`trtspec refresh SPEC --url HOST:PORT --head NEW`: swap a better head into a running deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trtspec.cli.common import EnginesOpt, JsonFileOpt, JsonOpt, MetricsPortOpt, SpecArg, handle_errors, spec_with
from trtspec.cli.output import emit
from trtspec.errors import RequestError
from trtspec.spec import LoadedSpec, load_spec

Opt = typer.Option
UrlOpt = Annotated[str, Opt("--url", help="The running deployment's gRPC endpoint, HOST:PORT.")]
HeadOpt = Annotated[Path | None, Opt("--head", help="The new head (`distill --from-capture -o NEW`).")]
MarginOpt = Annotated[float, Opt("--margin", min=0.0, max=1.0, help="How much higher NEW's k=1 acceptance must be.")]
RollbackOpt = Annotated[bool, Opt("--rollback", help="Put back the head that served before the live one.")]
EveryOpt = Annotated[str | None, Opt("--every", help="Loop: capture -> distill --from-capture -> refresh, every DURATION.")]
RoundsOpt = Annotated[int | None, Opt("--rounds", min=1, help="With --every: stop after N rounds.")]
MaxStepsOpt = Annotated[int | None, Opt("--max-steps", min=1, help="With --every: each round's training steps.")]
ReplayOpt = Annotated[float | None, Opt("--replay", min=0.0, max=0.99, help="With --every: distill's --replay.")]
RefreshDirOpt = Annotated[
    Path | None, Opt("--refresh-dir", help="Where heads are built and trained (default <engines>.refresh).")
]


@handle_errors
def refresh(
    spec: SpecArg,
    url: UrlOpt,
    head: HeadOpt = None,
    margin: MarginOpt = 0.0,
    rollback: RollbackOpt = False,
    metrics_port: MetricsPortOpt = None,
    every: EveryOpt = None,
    rounds: RoundsOpt = None,
    max_steps: MaxStepsOpt = None,
    replay: ReplayOpt = None,
    engines: EnginesOpt = None,
    refresh_dir: RefreshDirOpt = None,
    as_json: JsonOpt = False,
    json_file: JsonFileOpt = None,
) -> None:
    """Put NEW into the running Triton deployment at --url without a restart or a model reload.

    Only when NEW's acceptance at k=1 on its held-out captured requests beats the live head's
    by --margin; every endpoint instance loads it while the live head drafts, the requests in
    flight finish on the live head, new ones draft with NEW; then `verify --url` must find the
    speculative answers identical to target-only, or the live head is put back. Run it where
    the spec's engines are (--engines as `serve --engines`) and the control file is (the
    repository's eagle3_head.json, or $TRTSPEC_HEAD_CONTROL). Exit 1 when NEW is not deployed
    (not better, or a divergence), 2 on bad input (no head folder, no server at --url, a
    server started with another spec's head), 3 when the server's instances do not take the
    head (the live head serves again), 130 interrupted.

    Examples:
      trtspec refresh my.yaml --url 127.0.0.1:8001 --head heads/v2 --margin 0.02
      trtspec refresh my.yaml --url 127.0.0.1:8001 --rollback
      trtspec refresh my.yaml --url 127.0.0.1:8001 --every 30m --max-steps 300
    """
    from trtspec.distill.refresh import check_head
    from trtspec.distill.refresh import refresh as deploy
    from trtspec.distill.refresh import refresh_dir as refresh_folder
    from trtspec.distill.refresh import rollback as back
    from trtspec.distill.swap import Deployed
    from trtspec.triton.client import parse_url

    loaded = _loaded(spec, engines)
    folder = refresh_dir or refresh_folder(loaded)
    url = parse_url(url)
    metrics_url = f"{url.rpartition(':')[0]}:{metrics_port or loaded.spec.serve.metrics_port}"
    if [head is not None, rollback, every is not None].count(True) != 1:
        raise RequestError("refresh takes one of --head NEW, --rollback or --every DURATION")
    if every is not None:
        flags = {"--max-steps": max_steps, "--replay": replay}
        extra = [x for flag, value in flags.items() if value is not None for x in (flag, str(value))]
        _loop(loaded, url, metrics_url, every, rounds, extra, margin, folder)
        return
    if head is not None:
        check_head(head)  # before the server is asked anything
    deployed = Deployed(loaded, url, metrics_url)
    result = back(loaded, deployed, _identical) if rollback else deploy(loaded, deployed, head, _identical, margin, folder)
    emit(result, lambda out: out.print(result.summary()), as_json=as_json, json_file=json_file)


def _loaded(spec: Path, engines: Path | None) -> LoadedSpec:
    """The spec, its engines at --engines where given (as `trtspec serve --engines` served them)."""
    loaded = load_spec(spec)
    if engines is None:
        return loaded
    return spec_with(loaded, "--engines", output_dir=str(engines.resolve()))


def _identical(loaded: LoadedSpec, url: str) -> bool:
    """`verify --url`: the served speculative answers are the target-only ones."""
    from trtspec.verify.run import VerifyOptions
    from trtspec.verify.run import run as verify

    return verify(loaded, loaded.output_dir(), VerifyOptions(url=url)).passed


def _loop(
    loaded: LoadedSpec, url: str, metrics_url: str, every: str, rounds, extra: list[str], margin: float, folder: Path
) -> None:
    from trtspec.distill.refresh_loop import LoopOptions, loop
    from trtspec.recipe import parse_duration

    try:
        every_s = parse_duration(every)
    except ValueError as err:
        raise RequestError(f"--every {err}") from None
    capture = loaded.capture_dir()
    if capture is None or every_s is None:
        raise RequestError("refresh --every trains on what serve.capture keeps: give the spec serve.capture and a period")
    loop(loaded, url, metrics_url, LoopOptions(every_s, capture, folder, rounds, extra), _identical, margin)
