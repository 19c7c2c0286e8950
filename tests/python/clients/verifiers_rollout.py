"""Runs in the `verifiers` virtual environment (its openai<3 pin conflicts with the tests'
SDK): the verifiers train client (`TrainClient`, which renders chats with a local Hugging Face
tokenizer and calls `/inference/v1/generate`) plays a two-turn rollout against the server named
by argv[1], tokenizing with the folder argv[2] (`flywheel export-tokenizer`). Prints one JSON
line per turn: the prompt and completion ids and the completion's logprobs, as the client got
them; the calling test checks them against the server."""

import asyncio
import json
import os
import sys

from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.types import SamplingConfig


async def main(base, tokenizer_dir, model):
    os.environ["FLYWHEEL_TEST_KEY"] = "test-key"
    client = TrainClient(TrainClientConfig(
        base_url=base + "/v1", api_key_var="FLYWHEEL_TEST_KEY",
        renderer_model_name=tokenizer_dir))
    sampling = SamplingConfig(temperature=1.0, max_tokens=24, seed=7)
    messages = [{"role": "user", "content": "Name a fruit."}]
    try:
        for turn in range(2):
            body = {"model": model, "messages": messages}
            r = await client.get_response(ChatDialect(), body, sampling)
            print(json.dumps({
                "turn": turn,
                "messages": messages,
                "prompt_ids": list(r.tokens.prompt_ids),
                "completion_ids": list(r.tokens.completion_ids),
                "completion_logprobs": list(r.tokens.completion_logprobs),
                "content": r.message.content,
                "finish_reason": r.finish_reason,
            }), flush=True)
            messages = messages + [{"role": "assistant", "content": r.message.content or ""},
                                   {"role": "user", "content": "Another one."}]
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
