"""Train the bundled model's byte-level BPE tokenizer with the ``tokenizers`` library."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "train_tokenizer"]

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]

# Renders messages exactly as the customer-service corpus writes dialogues, so that the chat
# endpoint asks the model in the form it was trained on.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer over ``texts``, wrapped for ``transformers``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        padding_side="left",  # decoder-only generation continues from the right edge
        clean_up_tokenization_spaces=False,
    )
