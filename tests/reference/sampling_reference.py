#!/usr/bin/python3
"""The next-token rule, written from the published definitions, not from the engine:

  * penalties on the raw logits (Hugging Face's RepetitionPenaltyLogitsProcessor over prompt and
    output tokens, then OpenAI's frequency and presence penalties over output tokens, in vLLM's
    order), each penalised logit rounded once to float32 as the engine stores logits;
  * greedy: the first largest penalised logit;
  * otherwise the candidates by logit (ties to the lower id), the top_k best, the softmax at the
    temperature relative to the best, min-p (probability >= min_p times the best's), the top-p
    nucleus (the smallest prefix whose mass reaches top_p), and one draw u in [0, 1) from
    std::mt19937_64 seeded with the request's seed: u = (next() >> 11) * 2^-53, the first
    candidate whose cumulative weight exceeds u times the total;
  * log-probabilities: log-softmax of the raw logits (before penalties, temperature and
    truncation), the top ones best first with ties to the lower id.

The generator is the C++ standard's mt19937_64 ([rand.predef]: its 10000th output from the
default seed is 9981545732273789042), implemented here in plain Python.
"""

import math
import sys
from collections import Counter

import numpy as np

MASK64 = (1 << 64) - 1


class MT19937_64:
    N, M = 312, 156
    MATRIX_A = 0xB5026F5AA96619E9
    UPPER, LOWER = 0xFFFFFFFF80000000, 0x7FFFFFFF

    def __init__(self, seed=5489):
        self.state = [seed & MASK64]
        for i in range(1, self.N):
            prev = self.state[-1]
            self.state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & MASK64)
        self.index = self.N

    def _twist(self):
        mt = self.state
        for i in range(self.N):
            x = (mt[i] & self.UPPER) | (mt[(i + 1) % self.N] & self.LOWER)
            xa = x >> 1
            if x & 1:
                xa ^= self.MATRIX_A
            mt[i] = mt[(i + self.M) % self.N] ^ xa
        self.index = 0

    def next(self):
        if self.index >= self.N:
            self._twist()
        x = self.state[self.index]
        self.index += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x & MASK64

    def uniform(self):
        return (self.next() >> 11) * 2.0 ** -53


def penalize(logits, prompt, output, params):
    """float32 logits after OpenAI's logit_bias (added in float32, first, as vLLM orders it) and
    then the repetition, frequency and presence penalties (on the biased values)."""
    rep = params.get("repetition_penalty", 1.0)
    freq = params.get("frequency_penalty", 0.0)
    pres = params.get("presence_penalty", 0.0)
    adjusted = np.array(logits, dtype=np.float32)
    for token, bias in params.get("logit_bias", {}).items():
        adjusted[token] = adjusted[token] + np.float32(bias)
    biased = adjusted.copy()
    counts = Counter(output)
    tokens = set(counts)
    if rep != 1.0:
        tokens |= set(prompt)
    for token in tokens:
        value = float(biased[token])
        value = value / rep if value > 0.0 else value * rep
        c = counts.get(token, 0)
        value = value - freq * c - pres * (1.0 if c > 0 else 0.0)
        adjusted[token] = np.float32(value)
    return adjusted


def choose(logits, prompt, output, params, rng):
    """The next token from raw float32 logits, given the prompt and the output so far."""
    adjusted = penalize(logits, prompt, output, params)
    temperature = params.get("temperature", 0.0)
    if temperature == 0.0:
        return int(np.argmax(adjusted))
    vocab = len(adjusted)
    order = np.lexsort((np.arange(vocab), -adjusted.astype(np.float64)))
    top_k = params.get("top_k", 0)
    kept = top_k if 0 < top_k < vocab else vocab
    best = float(adjusted[order[0]])
    weights = [math.exp((float(adjusted[order[i]]) - best) / temperature) for i in range(kept)]
    min_p = params.get("min_p", 0.0)
    if min_p > 0.0:
        above = 1
        while above < kept and weights[above] >= min_p:
            above += 1
        kept = above
    total = 0.0
    for i in range(kept):
        total += weights[i]
    top_p = params.get("top_p", 1.0)
    if top_p < 1.0:
        mass, nucleus = 0.0, 0
        while nucleus < kept:
            mass += weights[nucleus] / total
            nucleus += 1
            if mass >= top_p:
                break
        kept = nucleus
        total = 0.0
        for i in range(kept):
            total += weights[i]
    target = rng.uniform() * total
    cumulative = 0.0
    for i in range(kept):
        cumulative += weights[i]
        if target < cumulative:
            return int(order[i])
    return int(order[kept - 1])


def logprobs(logits, token, top):
    """(log-probability of token, [(id, log-probability)] of the `top` most likely)."""
    values = np.asarray(logits, dtype=np.float64)
    shifted = values - values.max()
    log_normalizer = values.max() + math.log(np.exp(shifted).sum())
    order = np.lexsort((np.arange(len(values)), -values))[:top]
    return (values[token] - log_normalizer,
            [(int(i), values[i] - log_normalizer) for i in order])


def replay(step_logits, prompt, params):
    """The tokens the rule draws given each step's raw logits (the engine's, one row per token)."""
    rng = MT19937_64(params.get("seed", 0))
    output = []
    for row in step_logits:
        output.append(choose(row, prompt, output, params, rng))
    return output


if __name__ == "__main__":
    # The standard's check value for mt19937_64.
    generator = MT19937_64()
    for _ in range(9999):
        generator.next()
    value = generator.next()
    if value != 9981545732273789042:
        sys.exit(f"mt19937_64: the 10000th value is {value}, not 9981545732273789042")
    print("mt19937_64 ok")
