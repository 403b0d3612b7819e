"""Run the OpenAI front: find the deployment's tokenizer and limits, build the app, serve it
with uvicorn (loopback unless told otherwise), its connections bounded (connections.py)."""

from __future__ import annotations

import time
from pathlib import Path

from trtspec import console
from trtspec.errors import ServerError, SpecError
from trtspec.layout import BLS_MODEL, tokenizer_folder
from trtspec.openai.keys import DEFAULT_TENANT, ApiKeys
from trtspec.triton.backend import callers
from trtspec.triton.repository import pbtxt
from trtspec.triton.repository.writer import read_repo_info


def front_settings(repo_dir: Path):
    """The served model's name, max_seq_len and tokenizer folder, from a written repository."""
    from trtspec.openai.app import FrontSettings

    repo_dir = Path(repo_dir)
    info = read_repo_info(repo_dir)
    config = repo_dir / BLS_MODEL / "config.pbtxt"
    if info is None or not config.is_file():
        raise SpecError(
            f"{repo_dir} is not a trtspec model repository; give the folder `trtspec serve` uses "
            "(model_repo/<spec name>) or the spec"
        )
    params = pbtxt.parse(config.read_text()).parameters
    settings = FrontSettings(
        model=info["spec"],
        max_seq_len=int(params["max_seq_len"].string_value),
        created=int(time.time()),
        suffix_scopes="suffix" in params and info.get("runtime") != "llmapi",
    )
    return settings, tokenizer_folder(Path(info["engines_dir"]), info["backend"])


def caller_key(url: str, keys: ApiKeys | None, scopes: bool) -> str | None:
    """The caller key of the Triton server at ``url`` (HOST:PORT), read from its key file on
    this machine, so its endpoints take this front's tenant scopes. None where none is readable:
    with several tenants (``keys``) on a deployment that reads scopes, that is refused (its
    tenants would share one scope); otherwise the deployment is one tenant and that is said."""
    key = callers.key_for_port(int(url.rsplit(":", 1)[1]))
    if key is None and keys is not None and scopes:
        raise ServerError(
            f"cannot read the caller key of the Triton server at {url}, so its endpoints would put every tenant in "
            "one suffix cache scope; run `trtspec openai` on the server's machine as the user who started it "
            f"(its key is {callers.SHM}/trtspec-caller-<server pid>)"
        )
    return key


def start_line(keys: ApiKeys | None, key: str | None, scopes: bool) -> str:
    """What the front says at start about its tenants (one line)."""
    if keys is None:
        narrowed = "`user` narrows its suffix cache scope" if key and scopes else "one suffix cache scope"
        return (
            f"no API keys: single-tenant deployment (every request is tenant {DEFAULT_TENANT!r}, {narrowed}); "
            "give --api-keys FILE to serve several tenants"
        )
    return f"API keys required: {len(keys.keys)} keys, {len(keys.tenants)} tenants, each its own suffix cache scope"


def make_app(repo_dir: Path, url: str, keys: ApiKeys | None = None):
    from transformers import AutoTokenizer

    from trtspec.openai.app import create_app
    from trtspec.openai.triton import TritonText

    settings, tok_dir = front_settings(repo_dir)
    key = caller_key(url, keys, settings.suffix_scopes)
    console.info(start_line(keys, key, settings.suffix_scopes))
    return create_app(TritonText(url, caller_key=key), AutoTokenizer.from_pretrained(tok_dir), settings, keys)


def run(
    repo_dir: Path,
    url: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    keys: ApiKeys | None = None,
    max_connections: int | None = None,
    head_timeout_s: float | None = None,
) -> None:
    """Serve until interrupted, the connections bounded (ConnectionBounds; ``max_connections``
    or ``head_timeout_s`` None: its default)."""
    import uvicorn

    from trtspec.openai.connections import ConnectionBounds, server_options

    given = {"max_connections": max_connections, "head_timeout_s": head_timeout_s}
    bounds = ConnectionBounds(**{name: value for name, value in given.items() if value is not None})
    uvicorn.run(make_app(repo_dir, url, keys), host=host, port=port, log_level="warning", **server_options(bounds))
