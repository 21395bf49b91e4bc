"""A model made locally for real vLLM engines: a Llama with random weights and no tokenizer.

No hub: ``transformers`` writes the config and safetensors weights, seeded, so
every engine (and every run) has the same model. Prompts are token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

__all__ = ["ModelShape", "make_model"]


@attrs.frozen(kw_only=True)
class ModelShape:
    """A Llama's shape.

    Attributes:
        layers: Decoder layers.
        hidden: Hidden size.
        heads: Attention heads (as many KV heads).
        intermediate: MLP size.
        vocab: Vocabulary (token ids below it).
        max_positions: Longest sequence.
        seed: Seeds the weights.
    """

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    intermediate: int = 256
    vocab: int = 1024
    max_positions: int = 4096
    seed: int = 0

    @property
    def parameters(self) -> int:
        """Roughly its parameters (embeddings, attention and MLP weights)."""
        per_layer = 4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate
        return 2 * self.vocab * self.hidden + self.layers * per_layer


def make_model(folder: Path, shape: ModelShape) -> Path:
    """Write the model of ``shape`` into ``folder`` (kept if it is already that model)."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "p2pactor-shape.json"
    wanted = json.dumps(attrs.asdict(shape), sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return folder
    import torch  # noqa: PLC0415 - heavy, and only here
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    torch.manual_seed(shape.seed)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Weights far from the initializer's (std 0.02, near-uniform logits), so
    # that greedy decoding depends on the whole prompt: a wrong byte of KV
    # anywhere in it changes the tokens.
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() >= 2:
                weight.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    marker.write_text(wanted)
    return folder
