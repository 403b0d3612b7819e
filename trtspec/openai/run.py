"""Run the OpenAI front: find the deployment's tokenizer and limits, build the app, serve it
with uvicorn (loopback unless told otherwise)."""

from __future__ import annotations

import time
from pathlib import Path

from trtspec.errors import SpecError
from trtspec.layout import BLS_MODEL, tokenizer_folder
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
    settings = FrontSettings(model=info["spec"], max_seq_len=int(params["max_seq_len"].string_value), created=int(time.time()))
    return settings, tokenizer_folder(Path(info["engines_dir"]), info["backend"])


def make_app(repo_dir: Path, url: str):
    from transformers import AutoTokenizer

    from trtspec.openai.app import create_app
    from trtspec.openai.triton import TritonText

    settings, tok_dir = front_settings(repo_dir)
    return create_app(TritonText(url), AutoTokenizer.from_pretrained(tok_dir), settings)


def run(repo_dir: Path, url: str, host: str = "127.0.0.1", port: int = 8080) -> None:
    import uvicorn

    uvicorn.run(make_app(repo_dir, url), host=host, port=port, log_level="warning")
