"""Log-probabilities of given tokens from the head, without the logits.

:func:`score_tokens` is what a trainer needs after a rollout (docs/design.md,
"Determinism and RL"): for tokens that were sampled (or any tokens: a
reference model's, a prompt's), their log-probabilities under the processed
distribution before and after truncation, under the raw logits, whether the
kept set holds them, and the entropies, from one pass over the head that
draws no noise: a GEMM with an online log-sum-exp, never the ``[N, V]``
logits. It runs the pass and the stage 2 of :func:`flashsample_jax.sample`
(:func:`flashsample_jax.stage2.score` follows :func:`~flashsample_jax.stage2.finish`
step for step), so on the same backend and batch a token ``sample`` drew
scores with the log-probabilities ``sample`` reported, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashsample_jax import api, backends, checks, controls as _controls, mesh, problem, stage2
from flashsample_jax.params import SamplingParams, STATIC_NAMES

__all__ = ["score_tokens", "ScoreOutput"]


class ScoreOutput(NamedTuple):
  """What :func:`score_tokens` returns, every field ``[B]``.

  Attributes:
    logprob: f32 ``log softmax(t)[token]`` before truncation (``t`` the
      tempered processed logits; greedy rows: temperature 1), as
      ``SampleOutput.logprob``.
    logprob_truncated: f32, the same over the kept set (renormalized);
      ``-inf`` where truncation removes the token, NaN where it keeps
      nothing (as ``SampleOutput.logprob_truncated`` of a greedy row then).
    logprob_raw: f32 under the raw logits (soft-capped only), as
      ``SampleOutput.logprob_raw``.
    entropy, entropy_truncated: f32, the row's entropies before and after
      truncation, as ``SampleOutput.entropy`` / ``entropy_truncated``.
    in_kept: bool, whether the kept set holds the token.
  """

  logprob: Any
  logprob_truncated: Any
  logprob_raw: Any
  entropy: Any
  entropy_truncated: Any
  in_kept: Any


# The options of score_tokens that must be static under jax.jit.
SCORE_STATIC_ARGNAMES = ("weight_layout", "vocab_size", "backend", "vocab_axis",
                         "batch_axis", "truncation_order", "top_logprobs",
                         "top_logprobs_mode", "return_kept")
# The output options that set the length of the pass's candidate lists
# (stage2.candidate_count): a row near their edge is certified on them or
# redone from materialized logits, so its floats follow them. score_tokens
# takes them as sample() does (and returns no lists).
_LIST_OPTIONS = ("top_logprobs", "top_logprobs_mode", "return_kept")
# SamplingParams' other output options: score_tokens returns its own
# outputs, so those fields are ignored (num_samples must be None: one token
# per row).
_OUTPUT_OPTIONS = tuple(n for n in STATIC_NAMES
                        if n != "truncation_order" and n not in _LIST_OPTIONS)


def _token_ids(token_ids, batch: int, vocab_size: int):
  """Checks ``token_ids`` (int ``[B]``, ids in ``[0, vocab_size)``): a
  concrete one eagerly, a traced one with a checkify check while traced
  checks are on (:mod:`flashsample_jax.checks`)."""
  if not hasattr(token_ids, "dtype") or not jnp.issubdtype(token_ids.dtype, jnp.integer):
    raise TypeError(f"token_ids must be an integer array [B], got "
                    f"{getattr(token_ids, 'dtype', type(token_ids).__name__)}")
  if token_ids.shape != (batch,):
    raise ValueError(f"token_ids.shape={tuple(token_ids.shape)} must be [B]=({batch},) "
                     "(one token per row of hidden)")
  ok = lambda t: (t >= 0) & (t < vocab_size)
  if not isinstance(token_ids, jax.core.Tracer):
    raw = np.asarray(token_ids)
    bad = ~ok(raw)
    if bad.any():
      i = int(np.argmax(bad))
      raise ValueError(f"token_ids[{i}]={raw[i]} must be in [0, {vocab_size}) "
                       f"(vocab_size); {int(bad.sum())} of {batch} out of range")
  else:
    good = ok(token_ids)
    i = jnp.argmin(good)
    checks.debug_check(jnp.all(good), f"token_ids[{{i}}]={{v}} must be in [0, {vocab_size})",
                       i=i, v=token_ids[i])
  return jnp.asarray(token_ids, jnp.int32)


def score_tokens(hidden, weight, token_ids, params=None, *, temperature=1.0,
                 weight_layout="vd", vocab_size=None, weight_scale=None, backend="auto",
                 vocab_axis=None, batch_axis=None, top_k=None, top_p=None, min_p=None,
                 logit_bias=None, allowed_mask=None, softcap=None,
                 repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
                 prompt_ids=None, output_ids=None, truncation_order="hf",
                 top_logprobs=0, top_logprobs_mode="processed", return_kept=0):
  """Scores given tokens under the distribution :func:`flashsample_jax.sample`
  draws from with the same arguments.

  Args:
    hidden, weight, weight_layout, vocab_size, weight_scale, backend,
    vocab_axis, batch_axis, temperature and the controls: as
      :func:`flashsample_jax.sample` (``params``: a
      :class:`~flashsample_jax.SamplingParams` instead of the control
      keywords; its output options are ignored but for the three below,
      its ``num_samples`` must be None).
    top_logprobs, top_logprobs_mode, return_kept: the ``sample`` call's. No
      list is returned; they set the length of the pass's candidate lists
      as in ``sample``, which a row's floats follow where truncation is on
      (a row near the lists' edge is certified on them or redone from
      materialized logits).
    token_ids: int ``[B]``, one token per row, in ``[0, vocab_size)``.

  Returns:
    A :class:`ScoreOutput`. For a token that ``sample`` returned for the
    same arguments and batch on the same backend (one of its
    ``num_samples`` draws too: ``tokens[j]``), its fields equal
    ``sample``'s ``logprob``, ``logprob_truncated``, ``logprob_raw``,
    ``entropy`` and ``entropy_truncated`` bit for bit, and ``in_kept`` is
    True, but for a greedy row whose kept set is empty (a ``+inf`` logit
    with min-p, a traced invalid rule): its argmax is returned, not kept,
    and ``logprob_truncated`` is NaN in both. (``"auto"`` may pick another
    backend for S samples than for one row each: name the backend where
    the bits must match.)

  Raises:
    TypeError, ValueError: as :func:`flashsample_jax.sample`, and for
      ``token_ids`` of the wrong dtype, shape or range (traced ids get a
      ``checkify`` check while traced checks are on).
    NotImplementedError: the named backend cannot score (the xla and dense
      backends can; ``"auto"`` picks one).
  """
  given = {k: v for k, v in locals().items() if k in _controls_names()}
  axes = mesh.MeshAxes.of(vocab_axis, batch_axis)
  ctl = _settings(params, given)
  p, c = api.prepare_call(hidden, weight, jax.random.key(0),
                          weight_layout=weight_layout, vocab_size=vocab_size,
                          weight_scale=weight_scale, axes=axes, controls=ctl)
  tokens = _token_ids(token_ids, p.batch, p.vocab_size)
  c = dataclasses.replace(c, given_ids=tokens, noise=False)
  impl = backends.resolve(backend, p, c)
  if p.batch == 0:
    empty = jnp.zeros((0,), jnp.float32)
    return ScoreOutput(empty, empty, empty, empty, empty, jnp.zeros((0,), bool))
  return _run(p, c, backend=impl, axes=axes)


def _controls_names():
  return {f.name for f in dataclasses.fields(SamplingParams)} - set(_OUTPUT_OPTIONS)


def _settings(params, given: dict) -> dict:
  """The controls of the call (``params`` or the keywords), with the outputs
  a score needs."""
  full = {**{n: getattr(SamplingParams(), n) for n in _OUTPUT_OPTIONS}, **given}
  ctl = api.settings(params, full)
  if ctl.get("num_samples") is not None:
    raise ValueError(f"params.num_samples={ctl['num_samples']} must be None: "
                     "score_tokens scores one token per row")
  ctl = {k: v for k, v in ctl.items() if k not in _OUTPUT_OPTIONS}
  # Raw top-N lists (top_logprobs_mode="raw") are kept: they do not size
  # the processed lists, but they decide the route (the kernels do not
  # list raw logits), and the bits follow the backend.
  return dict(ctl, return_logprobs=True, return_entropy=True, return_raw_logprobs=True)


@functools.partial(jax.jit, static_argnames=("backend", "axes"))
def _run(p: problem.Problem, c: _controls.Controls, *, backend, axes: mesh.MeshAxes):
  offset = axes.vocab_offset(p.weight_rows)
  st = api.pass_state(p, c, backend, offset)
  sc = stage2.score(p, c, st, axis=axes.vocab)
  kept_lp = jnp.where(sc.in_kept | (sc.lse_kept == -jnp.inf),
                      _controls.truncated_logprob(sc.t_tok, sc.lse_kept), -jnp.inf)
  return ScoreOutput(logprob=sc.t_tok - sc.lse_all, logprob_truncated=kept_lp,
                     logprob_raw=sc.logprob_raw, entropy=sc.ent_all,
                     entropy_truncated=sc.ent_kept, in_kept=sc.in_kept)
