"""Which step size and schedule of the bias rule bring a collapsed router back, swap after swap?

    python -m bench.bias_schedule            # about a minute on 2 CPU cores

The engine ``bias`` strategy (:mod:`mla_watch.retune.engine_retuning`) steps an ``e_score_correction_bias``
from the loads the engine routed, one swap per step. This replays that loop on the bundled model
(layer 1 collapsed: +10 on the bias of six experts, 2.585 bits), with the model itself as the
engine: each step routes 32 mixed-domain samples, counts layer 1's loads and moves the bias by
:func:`mla_watch.retune.engine_retuning.bias_step` (proportional) or by DeepSeek's sign rule, with the step
``gamma * decay ** step``. Printed: layer 1's entropy after each step, per schedule, and the first
step from which it stays in the band (>= 5.2 bits, the shipped rule's resolve threshold).
"""

from __future__ import annotations

import numpy as np
import torch

import mla_watch
from mla_watch.models import corpus
from mla_watch.probe import attach
from mla_watch.quality.local_model import make_batches
from mla_watch.retune.engine_retuning import bias_step
from mla_watch.routing.stats import entropy_bits

ROUTER = "model.layers.1.mlp.gate"
BAND = 5.2
STEPS = 10
SCHEDULES = [
    ("proportional", 1.0, 0.7),
    ("proportional", 1.0, 1.0),
    ("proportional", 0.5, 1.0),
    ("sign", 1.0, 1.0),
    ("sign", 2.0, 0.7),
    ("sign", 0.05, 1.0),
]


def main() -> None:
    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    gate = model.model.layers[1].mlp.gate
    healthy = gate.e_score_correction_bias.detach().clone()
    texts = [text for domain in corpus.DOMAINS for text in corpus.generate(domain, 8, seed=3)]
    batches = make_batches(
        [tokenizer(text)["input_ids"][:64] for text in texts], batch_size=8, pad_id=tokenizer.pad_token_id or 0
    )
    probe = attach(model, window_tokens=None)

    def loads() -> np.ndarray:
        probe.reset()
        with probe.attribute("bench"), torch.no_grad():
            for batch in batches:
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return np.asarray(probe.counts("bench")[ROUTER], dtype=np.float64)

    print(f"{'rule':<14}{'gamma':>6}{'decay':>6}  bits after each step (collapsed: step 0)    in band from step")
    for rule, gamma, decay in SCHEDULES:
        with torch.no_grad():
            gate.e_score_correction_bias.copy_(healthy)
            gate.e_score_correction_bias[:6] += 10.0
        bias = gate.e_score_correction_bias.detach().float().clone()
        readings = []
        for step in range(STEPS + 1):
            load = loads()
            readings.append(entropy_bits(load))
            step_gamma = gamma * decay**step
            if rule == "sign":
                bias = bias + torch.as_tensor(step_gamma * np.sign(load.mean() - load), dtype=torch.float32)
            else:
                bias = bias_step(bias, load, step_gamma)
            with torch.no_grad():
                gate.e_score_correction_bias.copy_(bias)
        settled = next((step for step in range(len(readings)) if all(r >= BAND for r in readings[step:])), None)
        print(
            f"{rule:<14}{gamma:>6g}{decay:>6g}  "
            + " ".join(f"{r:.2f}" for r in readings)
            + f"    {settled if settled is not None else 'never'}"
        )
    probe.detach()


if __name__ == "__main__":
    main()
