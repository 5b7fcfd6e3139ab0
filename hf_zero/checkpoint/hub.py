"""Push an exported model folder to the Hugging Face Hub with the real `huggingface_hub` client."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from .source import MANIFEST, CheckpointError

DEFAULT_MESSAGE = "Upload model exported with hf_zero"


def push_to_hub(folder: Union[str, os.PathLike], repo_id: str, token: Optional[str] = None, private: bool = False,
                commit_message: str = DEFAULT_MESSAGE, revision: Optional[str] = None):
    """Create `repo_id` if needed (`HfApi.create_repo(exist_ok=True)`) and upload `folder` in one commit
    (`HfApi.upload_folder`). `folder` is an export (`export_pretrained` / `hf-zero consolidate`), not a sharded
    training checkpoint. Honours `HF_ENDPOINT` and `HF_TOKEN` as huggingface_hub does. Returns the CommitInfo."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    if (folder / MANIFEST).is_file():
        raise CheckpointError(f"{folder} is a sharded hf_zero training checkpoint, which Transformers cannot load: "
                              f"export it first (hf-zero consolidate {folder} OUT_DIR) and push OUT_DIR")
    if not any(folder.iterdir()):
        raise FileNotFoundError(f"{folder} is empty: nothing to push")
    api = HfApi(token=token)
    repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    return api.upload_folder(folder_path=str(folder), repo_id=repo.repo_id, repo_type="model",
                             commit_message=commit_message, revision=revision)
