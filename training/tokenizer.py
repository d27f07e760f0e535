"""Byte-level BPE tokenizer for the demo model (Hugging Face `tokenizers`).

Byte-level so every Python source file round-trips exactly (no unknown tokens). One
special token, `<|endoftext|>` (id 0), separates documents and serves as BOS, EOS and pad.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from runtime.engine_dir import TOKENIZER_CONFIG_FILE

EOT = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Prompts start a document, as every training document did (after a separator):
    # the tokenizer itself prepends BOS, as Llama's tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, tok.token_to_id(EOT))]
    )
    return tok


CHAT_TEMPLATE = (
    "{#- specpipe demo chat format: system/developer messages become Python comment lines, "
    "a user message is code the assistant continues (as is: no newline added, BPE merges it with what follows), "
    "an assistant message ends with EOS (a file boundary in training). -#}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'system' or message['role'] == 'developer' %}\n"
    "{{- '# ' + message['content'] | replace('\\n', '\\n# ') + '\\n' }}\n"
    "{%- elif message['role'] == 'user' %}\n"
    "{{- message['content'] }}\n"
    "{%- elif message['role'] == 'assistant' %}\n"
    "{{- message['content'] + eos_token }}\n"
    "{%- else %}\n"
    "{{- raise_exception('role ' + message['role'] + "
    "' is not supported: use system, developer, user or assistant') }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
)
"""The demo models' chat format (jinja2, as transformers' `apply_chat_template` reads it):
system/developer messages become Python comment lines, a user message is code the
assistant continues, an assistant message ends with EOS. The OpenAI server renders it."""


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write `tokenizer.json` plus the `tokenizer_config.json` that lets
    `transformers.AutoTokenizer.from_pretrained(out_dir)` load it too."""
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "pad_token": EOT,
                "unk_token": None,
                "model_max_length": model_max_length,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
