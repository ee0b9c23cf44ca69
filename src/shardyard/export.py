"""HF export: safetensors + config + tokenizer, loadable by ``AutoModelForCausalLM.from_pretrained`` (a model
that is not an HF model exports ``model.safetensors`` and the tokenizer). With adapters (``peft=lora``) the
export is the merged model, and the adapter alone goes to ``adapter/`` beside it in PEFT's format."""

from __future__ import annotations

import os
from typing import Any
import shutil
import tempfile

from shardyard.backends import Backend
from shardyard.data import load_tokenizer
from shardyard.model import is_hf


def save_hf(backend: Backend, tokenizer_dir: str, out_dir: str) -> str | None:
    """Collective: every rank calls it; rank 0 writes ``out_dir`` atomically (temp dir, then rename)."""
    state = backend.full_state_dict()
    if backend.rank != 0:
        return None
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-hf-")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    assert state is not None  # rank 0 holds the gathered state
    model: Any = backend.hf_model()
    from shardyard import adapters

    if adapters.is_peft(model):
        tmp_adapter = tempfile.mkdtemp(dir=parent, prefix=".tmp-adapter-")
        adapters.save_adapter(model, state, tmp_adapter)
        load_tokenizer(tokenizer_dir).save_pretrained(tmp_adapter)
        _publish(tmp_adapter, os.path.join(parent, "adapter"))
        state = adapters.merged_state(state, model)
        model = model.get_base_model()
    if is_hf(model):
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    else:  # a plain nn.Module (shardyard.model.CausalLM): its weights, for its own builder to load
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"))
    load_tokenizer(tokenizer_dir).save_pretrained(tmp)
    _publish(tmp, out_dir)
    return out_dir


def _publish(tmp: str, out_dir: str) -> None:
    if os.path.exists(out_dir):  # replace an older export only once the new one is complete
        old = out_dir + ".old"
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
