"""Transformer models, from a bare stack of blocks to complete training objectives.

NakedTransformer            blocks + final norm on hidden states (no vocabulary)
TransformerWithEmbeddingHead  + token embeddings: ids in, hidden states out
TransformerWithLMHead       + output projection: ids in, logits out
AutoregressiveModel         causal language modelling loss
BERTModel                   masked language modelling loss

Module names follow Hugging Face Llama (``model.layers.3.mlp.up_proj.weight``), so a
Llama-shaped model's state dict is already in canonical names.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from matformer.modeling.attention import AttentionContext
from matformer.modeling.batch import Batch, TokenLayout, layout, next_token_targets
from matformer.modeling.components.init import linear
from matformer.modeling.components.loss import IGNORE_INDEX
from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import ConfigError
from matformer.modeling.generation_cache import KVCache
from matformer.modeling.layer_spec import ModelSpec, model_spec
from matformer.modeling.matformer import Tier, layer_widths
from matformer.modeling.prompt_marks import read_marks
from matformer.modeling.spec import build_module


class NakedTransformer(nn.Module):
    """The block stack with positional encoding and final norm: (B, T, C) → (B, T, C)."""

    def __init__(self, config: ModelConfig, spec: ModelSpec | None = None) -> None:
        config.validate()
        spec = spec or model_spec(config)  # resolves every name before allocating
        super().__init__()
        self.config = config
        self.embed_positions = build_module(spec.positional, config=config)
        self.layers = nn.ModuleList(build_module(layer, config=config, layer_number=number)
                                    for number, layer in enumerate(spec.layers, start=1))
        self.norm = build_module(spec.final_norm, config=config)

    def forward(
        self,
        inputs: Tensor | Batch | TokenLayout,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        tier: Tier | None = None,
        cache: KVCache | None = None,
        *,
        encoder_states: Tensor | None = None,
        encoder_mask: Tensor | None = None,
    ) -> Tensor:
        """``inputs``: a tensor, with an optional (B, T) ``attention_mask`` (1 = real token),
        or a MaskedBatch / PackedBatch; ``tier`` picks the FFN widths; ``cache`` holds the
        keys and values of earlier positions while generating (modeling/generation.py);
        ``encoder_states`` (B, S, C) and ``encoder_mask`` (B, S), what blocks built with
        cross-attention read."""
        tokens = layout(inputs, attention_mask, position_ids)
        widths = layer_widths(self.config, tier)
        hidden = self.input_embeddings(tokens.data)  # (B, T, C)
        length = hidden.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}; shorten the input or raise the limit."
            )
        hidden = self.embed_positions.embed(hidden, tokens.position_ids)
        context = AttentionContext(
            positional=self.embed_positions,
            positional_state=self.embed_positions.prepare(tokens.position_ids, hidden.dtype),
            causal=self.config.is_causal,
            segment_ids=tokens.segment_ids,
            cache=cache,
            encoder_states=encoder_states,
            encoder_mask=encoder_mask,
        )
        for layer, width in zip(self.layers, widths, strict=True):
            hidden = layer(hidden, context, width)
        return self.norm(hidden)

    def input_embeddings(self, data: Tensor) -> Tensor:
        """The hidden states the blocks start from; the bare stack takes them as given."""
        return data


class TransformerWithEmbeddingHead(NakedTransformer):
    """Token ids (B, T) → hidden states (B, T, C)."""

    def __init__(self, config: ModelConfig, spec: ModelSpec | None = None) -> None:
        spec = spec or model_spec(config)
        super().__init__(config, spec)
        self.embed_tokens = build_module(spec.embedding, config=config)

    def input_embeddings(self, data: Tensor) -> Tensor:
        return self.embed_tokens(data)


class TransformerWithLMHead(nn.Module):
    """Token ids (B, T) → logits (B, T, V); ``lm_head`` may share the embedding weight."""

    def __init__(self, config: ModelConfig) -> None:
        config.validate()
        spec = model_spec(config)
        super().__init__()
        self.config = config
        self.model = TransformerWithEmbeddingHead(config, spec)
        self.lm_head = linear(config, config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.loss_fn = build_module(spec.loss, config=config)

    def forward(
        self,
        inputs: Tensor | Batch | TokenLayout,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        tier: Tier | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        return self.lm_head(self.model(inputs, attention_mask, position_ids, tier, cache))

    def example_targets(self, ids: Tensor, generator: torch.Generator | None = None
                        ) -> tuple[Tensor, Tensor]:
        """(what the model reads, the label of each position) for one document ``ids`` (T,);
        IGNORE_INDEX where a position carries no loss. Training draws these per document
        before batching, so padding, packing and microbatching never change them. A prompt
        token (``ids`` may carry prompt marks: modeling/prompt_marks.py) is read, never a
        target."""
        raise NotImplementedError

    def labelled_loss(self, inputs: Batch, labels: Tensor, tier: Tier | None = None,
                      reduction: str = "mean") -> Tensor:
        """Cross-entropy of ``inputs`` against ``labels`` (B, T) laid out as the batch is."""
        return self.loss_fn(self(inputs, tier=tier), labels, reduction=reduction)


class AutoregressiveModel(TransformerWithLMHead):
    """GPT-style: predict token t+1 from tokens ≤ t."""

    def __init__(self, config: ModelConfig) -> None:
        if not config.is_causal:
            raise ConfigError("AutoregressiveModel needs is_causal=true (a causal mask).")
        super().__init__(config)

    def loss(
        self,
        inputs: Tensor | Batch,
        attention_mask: Tensor | None = None,
        tier: Tier | None = None,
        reduction: str = "mean",
    ) -> Tensor:
        """Next-token cross-entropy over the positions ``num_targets`` counts: padding and
        the last token of each document predict nothing. ``reduction``: "mean" or "sum"."""
        tokens = layout(inputs, attention_mask)
        logits = self(tokens, tier=tier)  # (B, T, V)
        # Shift the labels, not the logits: slicing logits would copy (B, T-1, V) forward and
        # zero-fill a (B, T, V) gradient backward.
        labels = next_token_targets(tokens.data, tokens.segment_ids, IGNORE_INDEX)
        return self.loss_fn(logits, labels, reduction=reduction)

    def example_targets(self, ids: Tensor, generator: torch.Generator | None = None
                        ) -> tuple[Tensor, Tensor]:
        """The document as it is, each position labelled with the next token unless that
        is a prompt token; the last position predicts nothing."""
        ids, trained = read_marks(ids)
        labels = torch.where(trained[1:], ids[1:], IGNORE_INDEX)
        return ids, F.pad(labels, (0, 1), value=IGNORE_INDEX)

    def num_targets(self, inputs: Tensor | Batch, attention_mask: Tensor | None = None) -> int:
        """How many positions of ``inputs`` carry a loss (the divisor of the mean)."""
        tokens = layout(inputs, attention_mask)
        labels = next_token_targets(tokens.data, tokens.segment_ids, IGNORE_INDEX)
        return int((labels != IGNORE_INDEX).sum())


class BERTModel(TransformerWithLMHead):
    """BERT-style: replace a fraction of tokens with the mask token and predict them."""

    def __init__(self, config: ModelConfig) -> None:
        if config.is_causal:
            raise ConfigError("BERTModel needs is_causal=false (bidirectional attention).")
        if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
            raise ConfigError(
                "BERTModel needs a mask_token_id inside the vocabulary "
                f"(0..{config.vocab_size - 1}), got {config.mask_token_id!r}."
            )
        super().__init__(config)

    def mask_tokens(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(masked ids, labels): each real token is masked with ``masked_substitution_rate``.

        The draws come from ``generator`` on the CPU whatever the ids' device, so a seed
        gives the same mask on every device."""
        draw = torch.rand(input_ids.shape, generator=generator).to(input_ids.device)
        masked = draw < self.config.masked_substitution_rate
        if attention_mask is not None:
            masked &= attention_mask.to(torch.bool)
        return self._masked(input_ids, masked)

    def example_targets(self, ids: Tensor, generator: torch.Generator | None = None
                        ) -> tuple[Tensor, Tensor]:
        """The document with tokens masked, labelled with the originals; prompt tokens are
        never masked. A document the draw leaves unmasked gets its most-likely-drawn token
        that may be masked, so that every document carries a target, as ``target_tokens``
        promises (one of prompt tokens alone carries none)."""
        ids, trained = read_marks(ids)
        draw = torch.rand(ids.shape, generator=generator).to(ids.device)
        masked = (draw < self.config.masked_substitution_rate) & trained
        if not bool(masked.any()) and bool(trained.any()):
            masked[draw.masked_fill(~trained, 2.0).argmin()] = True  # draws are < 1
        return self._masked(ids, masked)

    def _masked(self, ids: Tensor, masked: Tensor) -> tuple[Tensor, Tensor]:
        """(``ids`` with the mask token where ``masked``, the original ids there as labels)."""
        labels = torch.where(masked, ids, IGNORE_INDEX)
        return ids.masked_fill(masked, self.config.mask_token_id), labels

    def loss(
        self,
        inputs: Tensor | Batch,
        attention_mask: Tensor | None = None,
        tier: Tier | None = None,
        generator: torch.Generator | None = None,
        reduction: str = "mean",
    ) -> Tensor:
        tokens = layout(inputs, attention_mask)
        real = None if tokens.segment_ids is None else tokens.segment_ids > 0
        masked_ids, labels = self.mask_tokens(tokens.data, real, generator)
        masked = replace(tokens, data=masked_ids)
        return self.loss_fn(self(masked, tier=tier), labels, reduction=reduction)


def build_model(config: ModelConfig) -> AutoregressiveModel | BERTModel:
    """The model a config's objective calls for: causal → Autoregressive, else BERT."""
    return AutoregressiveModel(config) if config.is_causal else BERTModel(config)
