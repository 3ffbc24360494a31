"""The chat templates of the families we run, as their models publish them (llama.cpp's copies in
``models/templates/`` of the llama-cpp-python sdist), render with our sandbox: the user's text is
found as user content, once, and the prompt ends with the family's own opening of the assistant's
turn (from the models' documentation, not from our renders)."""

from __future__ import annotations

import tarfile

import pytest

from llamacpp_sdist import sdist_path
from llamatrace.text.chat import render_chat

CHATML = "<|im_start|>assistant\n"
TEMPLATES = {                                   # file in models/templates/ -> how the assistant turn opens
    "Qwen-Qwen2.5-7B-Instruct": CHATML,
    "Qwen-Qwen3-0.6B": CHATML,
    "Qwen3.5-4B": CHATML + "<think>\n",
    "Qwen-QwQ-32B": CHATML + "<think>\n",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "<｜Assistant｜><think>\n",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "<｜Assistant｜><think>\n",
    "meta-llama-Llama-3.1-8B-Instruct": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "meta-llama-Llama-3.2-3B-Instruct": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "google-gemma-2-2b-it": "<start_of_turn>model\n",
    "microsoft-Phi-3.5-mini-instruct": "<|assistant|>\n",
    "openai-gpt-oss-120b": "<|start|>assistant",
    "HuggingFaceTB-SmolLM3-3B": CHATML,
    "mistralai-Mistral-Nemo-Instruct-2407": "[/INST]",
}
QUESTION = "What is 2+2?"


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    with tarfile.open(sdist_path()) as tar:
        members = {m.name.rsplit("/", 1)[-1].removesuffix(".jinja"): m for m in tar.getmembers()
                   if "/vendor/llama.cpp/models/templates/" in m.name and m.name.endswith(".jinja")}
        return {name: tar.extractfile(members[name]).read().decode("utf-8") for name in TEMPLATES}


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_published_template_renders_the_question_as_user_content(templates, name):
    parts = render_chat(templates[name], [{"role": "user", "content": QUESTION}], True,
                        bos_token="<s>", eos_token="</s>")
    assert [text for text, user in parts if user] == [QUESTION]
    prompt = "".join(text for text, _ in parts)
    # llama.cpp's copies of QwQ's and R1's close the thought at once unless enable_thinking is set
    assert prompt.removesuffix("</think>").rstrip("\n").endswith(TEMPLATES[name].rstrip("\n")), prompt[-120:]
    assert prompt.count(QUESTION) == 1
