"""Adaptive speculation: how large a tree each decoding request drafts this step, chosen to
maximise the batch's expected tokens per second (goodput, as SmartSpec, Liu et al. 2024),
with bounded exploration so it never settles on a stale estimate for good.

    goodput(s) = sum_r tau_r(s_r) / (forward(tokens(s)) + sum_m draft_m(s))

- s_r: the size (tree nodes, root included) request r drafts, one of the sizes its
  proposer offers (`Proposer.sizes`, ascending, nested: each tree holds the smaller ones;
  1 = the root alone, an auto-regressive step). Every method offers 1, so every method can
  be switched off per request and back on;
- tau_r(s): expected tokens per step (accepted drafts + the bonus) of request r at size s:
  its own running mean, decayed after a few trees (`REQUEST_EMA`), shrunk towards the
  estimate of its kind (method x greedy/sampled, `GROUP_EMA`) by how many trees it has
  seen (`REQUEST_PRIOR`, `REQUEST_NOISE`; for a wider beam it never drafted, where sizes
  are not all cuts, the shift of its largest smaller drafted size); a request's first steps
  lean on the kind's long-run estimate instead of its recent one (`FRESH_STEPS`: at batch 1
  the recent one is the request before); a size above the offer's cuts (a wider beam, a
  pruned tree, measured by probes now and then) is priced over the largest cut as it reads
  now (`OVER_CHAIN`); the kind's estimate is itself optimistic while it rests on few trees
  (`KIND_PRIOR` trees' worth of the `ceiling`, every level accepted; a size never measured:
  one token more than the next smaller, within its ceiling), so that unseen sizes get tried
  and a few unlucky first trees do not pass for the truth; a size above the smallest is
  also priced as the next smaller one plus the gain over it measured in the same trees
  (`kind_taus`). One verified tree measures every smaller nested size too: the accepted
  path stays accepted at size c as long as each of its nodes is in the tree of size c
  (`DraftTree.node_budget` <= c), exactly for greedy and in law for sampling;
- forward(n, r): seconds of a target forward of n tokens from r requests (`ForwardCost`;
  every price is learned in `step_costs.py`):
  a table over n (`TokenCost`, interpolated between measured sizes: small-M GEMMs are far
  from linear) timed at engine start on one request, plus a per-request-count residual
  learned from every live step (each request's attention over its own context: at batch
  8, 8 one-token requests cost 1.6x one 8-token request), kept apart for steps with trees
  and one-token steps (`ForwardCost`), as is each step's host work outside forward and
  drafting (`overhead`, `overhead_trees`). Keeping table and residual apart matters:
  a table refreshed by live steps alone mixes batch shapes, so that forward(8 tokens of 8
  requests) came out dearer than forward(40 tokens) and drafting looked free;
- draft_m: per method (per drafting path where a method's paths cost differently per level,
  `Offer.costs`: rsd-s's chains are drawn, its wider trees beam-searched; fitted together,
  a batch-1 step of its 5-node chain was priced at 8.0 ms where it took 6.65; a draft LM's
  greedy and sampled levels, ~3x apart on a GPU), intercept +
  per level + per drafted node + per token caught up +
  per request-level (`LinearCost` over the method's recent drafting calls of every shape
  it drafted; levels are its sequential drafter calls, request-levels the levels each
  drafting request goes through, summed: a draft LM's level attends over every request's
  own context, so one level of 8 requests costs far more than one of 1 request with the
  same nodes; a call's seconds include its drafted nodes' share of the step's
  verification, which at temperature > 0 walks the trees over full-vocabulary laws). A
  draft LM reads every token of a request it has not seen before it drafts
  (`Proposer.lag`: the whole prompt at a request's first draft, every token decoded
  since at the first draft after a run without drafting): a one-off cost, fitted apart
  so that it does not pass for the cost of a level (a fit that took a 150-token catch-up
  for level cost charged every later level ~3x its price), charged in full to a probe
  and, for a steady choice, spread over the steps a method's runs of drafting have
  lasted (`SpeculationPolicy.horizons`; once caught up, a request stays caught up while
  it drafts), never over more steps than the request has left (`CATCH_UP_WITHIN_LEFT`);
  a choice to draft starts the requests that must catch up a few a step, each step's
  catch-up within about two plain steps (`CATCH_UP_STAGE`).

Choice (`choose`): a few Dinkelbach iterations (maximising a ratio: at the current rate
lambda each request independently picks argmax_s tau_r(s) - lambda * marginal_cost_r(s)),
plus every uniform choice (all requests at size <= c: the fixed settings, AR included);
the best by the full cost model wins. ~10 evaluations of O(batch) each.

Exploration (`PROBE_SHARE`): each step earns credit, 2% of its predicted time; when the
credit covers a probe's expected loss (its time, its drafter's catch-up included, minus
the time its tokens would take at the chosen rate), one request not at its largest size
drafts its largest tree (the one with the least to catch up, then the one measured
longest ago: nested sizes are all measured by it; where sizes are not cuts of each other,
rsd-s's beams of each width, the size its kind measured longest ago: `_probe_size`; while
it drafts nothing, nested sizes' best: `PROBE_BEST_WHILE_PLAIN`, and where only the smaller
sizes are cuts, the largest cut: `PROBE_CHAINS_WHILE_PLAIN`), at
most once per `PROBE_EVERY` steps per kind of request whose largest size is not measured
anyway. So at batch 1 after a run of
bad drafts it re-probes every few dozen steps, at batch 32 every few steps, and throughput
lost to probing stays near 2% even when no probe pays: a probe is charged what it cost once
its step is timed, the slow plain steps after it included (`_settle_probe`). While a
decision drafts, each probe in a row that did not pay halves that share, twice at most
(`PROBE_BACKOFF`: whether *more* pays, where probes keep saying no); while nothing is
drafted, once (`PLAIN_BACKOFF`: whether drafting pays at all must be found again soon). A probe's tree
after a run of steps without trees counts against the trees behind its kind's estimate as
they have aged (`KIND_HALF_LIFE`), so an estimate set low long ago gives way within a few
probes where acceptance rose, instead of moving by `GROUP_EMA` a probe. Optimism (an
unmeasured size, `KIND_PRIOR`) prices the choice of one request of each kind per step
(`EXPLORERS`); the others are priced by the measurements, pessimistic about sizes few trees
measured (`_pessimistic`), so a batch does not draft what only optimism supports.

A settled decision stands while the requests and their options are the same and no probe
is due; exploration credit still accrues, and a probe that comes due ends it (`_Settled`):
- every request at size 1: for up to `RECHOOSE_EVERY` steps while nothing is drafted, twice
  as long each time it is made again (up to `PLAIN_STANDS_MOST`; made again after a probe
  ended it, as long as before: `PROBE_KEEPS_STAND`). A step without drafting
  brings no acceptance evidence, only a drifting forward time, so re-solving it would cost
  ~0.2 ms a step (2% of a one-token CPU forward) to reach the same answer;
- one that drafts, where the solve before drafted too: for `DRAFTING_STANDS` steps, while
  its own trees feed the estimates (a tree of a size it did not give, a probe's, ends it),
  and twice as long each time the solve at the end of its stand makes it again (up to
  `DRAFTING_STANDS_MOST`) while its trees yield what it expected of them (`STAND_Z`).
  Solved every step, the choice cost ~2% of a drafting step. A request's last steps cut
  its chain to the tokens it may still emit (`_within`: the same tokens) instead of
  solving afresh.

A new request of the same kind and options takes the place of one that left (at batch 1,
the next prompt) in either, for up to `DRAFTING_STANDS` steps more (`RECHOOSE_EVERY` in an
all-auto-regressive decision). Either also stands, for as many steps more at most, while
requests come and go around it (`CHURN_SHARE`: new ones fresh, of kinds and options it was
made for, each at the size of the first such), since a busy server's batch changes every few
steps.

Whatever the sizes, acceptance is lossless; the policy only moves speed.

This module and `step_costs.py` run compiled with mypyc where built (`native_policy.py`):
there the declared types are checked at run time, so a float stays a float (a float sum
starts at 0.0; a float constant is written 16.0), and a test that replaces one of its
functions runs on the Python form (`python_policy`).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import numpy as np

from runtime import step_costs
from runtime.step_costs import ByRequests, ForwardCost, LinearCost, by_requests, monotone

GROUP_EMA = 0.05
"""Least weight of a step's mean observation in an estimate shared by a kind of request.
Before that floor, the estimate is the mean over its trees (a step of n trees weighs n):
weighed per step instead, a batch-1 warm-up's few trees counted as much as 32 requests'
first trees, and ReDrafter at batch 32 priced its 6-node trees at 4.4-4.5 tokens for
steps after a first step's 32 trees made 3.2 (drafting ~20% slower than auto-regression
then)."""
KIND_HALF_LIFE = 32.0
"""Steps without trees (`SpeculationPolicy.idle`) after which the trees behind a kind's
estimate count half against the trees of its next measurement (`Estimate.weight`, never
below `KIND_LEAST_TREES`; the update weighs a step's n trees n / (n + what the old ones
count), `GROUP_EMA` at least). A batch that drafts nothing measures nothing but its
probes' trees, one every few dozen steps; counted at full weight against the many that set
the estimate, each moved it by `GROUP_EMA`, so an estimate set low (a closed batch's first
trees, which accept less; a run of hard text) stood long after acceptance rose: synthetic
traces of 300 poor steps, then drafts kept with probability 0.85, drafted again after
~180-340 steps at batch 8 and not within 400 at batch 32 (0.65-0.87 of the best fixed size
over the 400; with this, 0.93-0.97), and load-aware ReDrafter at batch 8 on held-out
prompts stayed auto-regressive for ~45-step stretches after a round's first tree step
(demo engine, 2-thread EPYC). Only steps without trees age estimates: counted in every
step, sizes that only probes measure (ReDrafter's wider beams beside the chains it drafts)
weighed each probe's tree more, and a lucky one had a batch-1 request draft them at a loss
for a few steps. Optimism and pessimism (`KIND_PRIOR`) still count every tree: aged there
too, a batch-1 request where drafts are rarely kept drafted again every ~6 steps (0.89 of
auto-regression in the synthetic trace, where the probes alone cost 4%)."""
KIND_LEAST_TREES = 2.0
"""What the trees behind an estimate count at least, however long ago (`KIND_HALF_LIFE`):
one probe's tree then moves it by at most a third of what it reads beyond it. Aged to
nothing, one lucky probe tree after a long plain run set the estimate alone, and a batch
that drafting does not pay drafted whole steps on it (Lyanna at batch 8, T=0: a 5-node
tree for every request, ~7 ms where the plain step takes ~2, right after a probe's).
Synthetic traces (`KIND_HALF_LIFE`'s) lose little by it: 0.93 / 0.97 of the best fixed
size at batch 8 / 32 after the shift, where no floor read 0.93 / 0.97 and 4 trees 0.90 /
0.91."""
KIND_PRIOR = 1.0
"""Trees' worth of optimism in a kind's estimate: it counts as if `KIND_PRIOR` trees had
yielded the most a tree can (`ceiling`), so its first measured trees outweigh that only
as they add up (weight n / (n + KIND_PRIOR)), as an upper confidence bound does. Taken
at face value, a warm-up's one tree that accepted nothing read as a settled 1.0 token per
step and kept sd at T=1, batch 1 auto-regressive for ~55 steps, until a probe."""
LONG_RUN_TREES = 64
"""Trees a kind's long-run estimate averages over (`SpeculationPolicy.long_run`: a step
of n trees weighs n / `LONG_RUN_TREES`, never more than `GROUP_EMA`, so from a batch of ~3
requests on it is the recent one). What a request is expected to yield before its own trees
say (`FRESH_STEPS`): at batch 1 the recent estimate (`GROUP_EMA`, ~20 trees) is the request
before, and Lyanna's chains keep 1.7 to 3.1 tokens a step from one held-out prompt to the
next; a request after a hard one started priced as that one, went auto-regressive and
stayed so, the next prompts too (whole rounds of 8 at batch 1, T=0, where its fixed chain
ran 1.6x on the first of them). Lockstep, 16 rounds, against that chain: 0.93 of it with
the recent estimate alone, 0.92 with 256 trees, 0.97 with 64. Fewer trees follow a lasting
fall faster: each fresh request drafts its first steps until the long run has followed
(synthetic, `test_a_fresh_request_is_priced_by_its_kinds_long_run_not_by_the_request_before`:
0.86 of auto-regression over 16 poor requests with 256 trees, 0.92 with 64, 0.95 without)."""
OVER_CHAIN = True
"""Price a size above its offer's cuts (ReDrafter's wider beams, Lyanna's pruned trees,
rsd-s's beam widths) as the largest cut's estimate now plus what its trees yielded over that
estimate when they were drafted (`SpeculationPolicy.over`), not by its trees' own mean.
Such sizes are mostly measured by probes, now and then, while the chain's estimate follows
the text: priced by their own mean, they read higher than the chain whenever the text turned
hard, and were drafted then. Lyanna at batch 1, T=0 (held-out prompts, lockstep, 16 rounds):
1.013x auto-regression against 0.993 off, its fixed 4-node chain 1.048; ReDrafter, rsd-s and
the T=1 cells within their noise."""
FRESH_STEPS = 4
"""Steps of a request after which its kind's recent estimate counts as much as the
long-run one in its row (`SpeculationPolicy._fresh`: weight `FRESH_STEPS` / (`FRESH_STEPS` +
n) on the long-run, none from 4 x `FRESH_STEPS` steps on; n rounded down to a power of two,
so that a batch's fresh requests share a few rows)."""
FRESH_SHIFT = 0.25
"""Tokens a step by which a fresh request's long-run row must differ from its kind's recent
one, at some size, to end a standing decision it steps into (`_standing`; "fresh")."""
REQUEST_EMA = 0.2
"""Weight of a new observation in one request's own estimate (acceptance drifts along a text)."""
REQUEST_PRIOR = 4
"""Observations a request's own estimate needs to count half against its kind's (shrinkage:
a few lucky or unlucky trees must not switch a request off for good)."""
REQUEST_NOISE = 1.25
"""Tokens per step by which a request's own estimate of `REQUEST_PRIOR` or more trees may
differ from its kind's by chance: only the excess counts. Fewer trees spread more, by
sqrt(REQUEST_PRIOR / n): one tree may be 2.5 tokens off. A tree's tokens spread ~1.5-2 (a
6-node chain yields 1 to 6), and a request whose own estimate of a size fell by chance
drafts smaller sizes, which do not measure it again (it comes back only as the estimate
ages, `REQUEST_HALF_LIFE`). At 0.75, ReDrafter on held-out prompts (demo engine, 2-core
Sapphire Rapids, 10 alternating rounds each) ran 1.85x auto-regression at batch 1 and 1.06x
at batch 4, where 1.25 ran 1.92x / 1.07x and no per-request shift at all 1.93x / 1.09x."""
REQUEST_HALF_LIFE = 8
"""Steps after which an unrefreshed own estimate counts half as much (it drifts back to its kind's)."""
PROBE_SHARE = 0.02
"""Share of step time that exploration may spend."""
PROBE_BACKOFF = 2
"""Halvings of `PROBE_SHARE` while a decision drafts, one per probe in a row that did not
pay (`futile`; a probe that pays, its step at least as productive as the choice it was
weighed against, its drafter's catch-up aside, restores the full share). Drafting, a probe
asks whether more pays: a batch-1 ReDrafter request drafting 6-node chains at T=0 probed its
21-node trees (~3.3 ms against a ~1.7 ms step) every ~37 steps, ~2.5% of its time, and they
never paid. While nothing is drafted, `PLAIN_BACKOFF`."""
PLAIN_BACKOFF = 1
"""Halvings of `PROBE_SHARE` while nothing is drafted, one per probe in a row that did not
pay (`futile_plain`; as `PROBE_BACKOFF`): whether drafting pays at all must be found again
within a few probes, so once only (twice, as while drafting, a batch of 32 whose acceptance
rose was not found again within 400 steps, and an unlucky first tree of rsd-c at T=1, batch
1 kept it auto-regressive ~6x longer). Where drafting never pays, exploration and the runs
of drafting that lucky probe trees start cost more than the probes' share: load-aware
ReDrafter at T=1 ran ~0.95-0.96x auto-regression where no probe at all ran ~0.98x (demo
engine, lockstep, 12-16 rounds). Once: 0.954 -> 0.969 and 0.961 -> 0.975 at batch 1, 0.934
-> 0.965 at batch 2; batch 8 -1.2 / +1.1% and batch 32 -1.1 / -0.6% in two runs each; the
draft LM at T=1, batch 1, where drafting pays (~1.6x): sd -2.0 +- 0.8%, rsd-c +1.1 +- 1.1%
(14 paired rounds). Whether a probe paid leaves its drafter's catch-up out (a draft LM's
first draft after a plain run reads every token it missed: a cost any run of drafting pays
once), or each probe after a longer plain run looks worse than the last (before, sd -2.5%
and -3.5% at batch 1)."""
PROBE_BEST_WHILE_PLAIN = True
"""While a request whose sizes are cuts of each other (`Offer.exact`) drafts nothing, its
probe drafts its best drafting size (by the rate its estimates give), not its largest: the
question then is whether drafting pays at all. Its largest (rsd-c's 15-node tree at T=1:
~4.5 ms of drafting where a 5-node chain takes ~1.5-2) cost so much that the credit covered
a probe once every ~100-270 steps, and its tree steps' host work priced the chains too:
load-aware rsd-c at T=1, batch 1 stayed auto-regressive after an unlucky first tree for
~1500 steps in one sweep of six, and for a whole sweep once (1.01-1.05x where the others
read 1.16-1.22x). Five alternating A/B processes of that cell, largest -> best: medians
1.17 / 1.19 / 0.96 / 1.23 / 1.23x -> 1.29 / 1.27 / 1.24 / 1.33 / 1.32x (the rest of the
A/B is in issue 16's notes). Drafting, it probes its largest as before (does more pay?)."""
PROBE_CHAINS_WHILE_PLAIN = True
"""While a request whose smaller sizes are cuts of each other but its larger ones are not
(ReDrafter's one-beam chains below its wider beams, rsd-s's chains below its beam widths:
`Offer.cuts`) drafts nothing, its probe drafts its largest cut, which measures every cut
below it: whether drafting pays at all is a question about its chains, and its wider beams
are probed in turn once it drafts (`_probe_size`). Probed in turn while plain, a 21-node
W=4 tree (ReDrafter at T=1, batch 2, demo engine, 2-thread EPYC) cost its step +3.5 ms and
the steps after it ~1.7 ms more, on ~1.4 ms steps, where a 6-node chain costs about a
third. Load-aware / AR, 10 alternating rounds each, rotation -> largest cut: T=1 batch 1
0.931 -> 0.939 (mean 0.935 -> 0.965), batch 2 0.938 -> 0.960, batch 8 0.969 -> 0.953 (mean
0.954 -> 0.953); T=0 batch 8 1.171 -> 1.165, its slowest round 1.02 -> 1.10 (after the
warm-up the first batch-8 trees, which keep fewer drafts, switched drafting off; a chain
probe, cheaper, came ~15 steps sooner and switched it back on)."""
PROBE_EVERY = 32
"""Fewest steps between probes of one kind of request (while its largest size is measured
no more often than this)."""
CATCH_UP_HORIZON = 16.0
"""Steps a choice to draft is expected to last before any run of drafting was seen: a
request that must catch up first (a draft LM behind by the tokens decoded without it) is
charged its catch-up spread over them per step of a steady choice (the whole of it for a
probe). Charged nothing (the policy before), a batch that drafting would gain a little
from drafted at once and paid every prompt's catch-up in the same steps: the demo engine,
sd at batch 16, T=0, ran 0.88x auto-regression (its drafting steps ~60% dearer than
predicted), 0.96x with the charge. Then the mean length of the method's runs of drafting
takes over (`HORIZON_EMA`): where drafting barely pays (sd at T=1, batch 8) each fresh
batch drafted a step or two, paid its prompts' catch-up (~4% of a 64-token round) and went
back to auto-regression; runs that short make the next catch-up dear enough to stay."""
HORIZON_EMA = 0.2
"""Weight of a finished run of drafting in its method's mean run length."""
CATCH_UP_STAGE = 2.0
"""Most catch-up a choice to draft starts in one step, in plain steps of the batch
(`_stage`): requests that must catch up before they draft (a draft LM's, after a prompt or
a run without drafting) start a few a step, the least behind first, like chunks of a
prefill. Started all at once, a choice to draft at batch 32 whose estimates came from
batch 1 (sd at T=0, its chains priced at 4.1 tokens a step where they made ~3) read ~3500
prompt tokens in one step (its drafting 54-62 ms, the step 77-81 ms where a plain step
takes ~5, every request's next token held that long) and went back to auto-regression
after it: one such round in six cost sd, rsd-c and rsd-s ~2% of their speed at batch 32.
In stages, the first one's trees end a choice that does not pay before the rest of the
batch has paid its catch-up, and one that pays has started every request a few steps
later."""
CATCH_UP_WITHIN_LEFT = True
"""A request's catch-up is spread over no more steps than it has left (`_catch_up`): its
`Offer.left` tokens at the most a step of it yields. Spread over its method's mean run of
drafting alone (~9-13 steps for sd at T=1, batch 8), a closed batch whose requests had 2-3
steps left chose to draft and paid their prompts' whole catch-up in one ~20 ms step (a plain
step of theirs: ~2.2 ms) for the two steps they had left."""
PLAIN_EVERY = 64
"""Steps after which a batch that drafts re-times its plain step (`_plain_probe`: a run of
plain steps, paid from the exploration credit like the first `PLAIN_SAMPLES`), as trees
are re-probed (`PROBE_EVERY`): a plain price set by a slow burst (a neighbour's load, a
CPU slowed by heavy GEMMs) is otherwise never corrected by a choice that then never picks
it. One run of load-aware Lyanna at batch 8, T=0 drafted 3-node trees in ~20% of its
request-steps and ran 0.83x auto-regression, where four reruns drafted none and ran
0.96-0.98x. Twice `PROBE_EVERY`: a run costs `AFTER_PREFILL` + 1 steps."""
EXPLORERS = 1
"""Requests of a kind per step whose choice is priced optimistically (`kind_taus`: a size
measured by few trees counts `KIND_PRIOR` trees' worth of its ceiling, a size never measured
one token above the next smaller); the kind's other requests are priced by the measured
means. Optimism gets a size tried, and one request's tree measures it for every request of
its kind; acted on by a whole batch, it drafted trees no measurement supported for every
request at once. ReDrafter at batch 8, T=0 (2-core Sapphire Rapids): 8 requests drafted
never-measured 11-node trees (6 tokens each expected, 26 in all made) in a 17.5 ms step
where auto-regression takes ~2.5, and after a one-request warm-up whose few trees kept
every draft, 6-node chains (48 tokens expected, 17 made): load-aware ran ~0.95x
auto-regression at batch 8, where drafting never pays. At batch 1 the one request is the
explorer: the choice there is what it was."""
DINKELBACH_ROUNDS = 3
RECHOOSE_EVERY = 16
"""Steps a settled all-auto-regressive decision stands while nothing is drafted (at 8, its
age caused ~40% of the full solves in ReDrafter's steps without drafting at batch 8, T=1:
~0.25 ms a solve on a ~6 ms step)."""
PLAIN_STANDS_MOST = 64
"""Steps an all-auto-regressive decision stands at most: made again at the end of its
stand, it stands twice as long (from `RECHOOSE_EVERY`). Its steps bring no acceptance
evidence, so re-solving it only follows the plain step's drifting price (a probe that
comes due still ends it): at batch 1, T=1 (ReDrafter, drafting never pays), solves every
`RECHOOSE_EVERY` + 1 steps were ~40% of the full solves, each ~0.4 ms on a ~1.25 ms step."""
PROBE_KEEPS_STAND = True
"""An all-auto-regressive decision that a probe ended, made again by the solve after the
probe, stands as long as it stood before (`_settle`), instead of `RECHOOSE_EVERY` doubled
back up to `PLAIN_STANDS_MOST`: each probe then cost its own two solves (the step it runs
in and the next, which takes its tree in) and no more. ReDrafter at T=1, batch 8 (demo
engine, drafting never pays, a probe every ~60 steps; its policy after 40 live steps asked
again and again for the same 8 requests): 68 -> 36 full solves in 1000 steps, each ~0.3 ms
on a ~3 ms step."""
CHURN_SHARE = 0.25
"""How far the requests in a step (decoding and prefilling) may drift from those a settled
decision was made for and it still stands (`_churned`, `_rebase`): at most this share of
them more or fewer, the new decoding ones fresh (no trees of their own) and of kinds and
options it was made for. With requests of 16-96 tokens streaming through a batch of 32
(Lyanna or ReDrafter, T=1), a request joining or leaving ended an all-auto-regressive
decision at ~70% of the steps, a ~0.4 ms solve each: the schedule phase cost +230-250 us a
step over AR's (`benchmarks/churn.py`). At batch 1-3 any change re-solves (a quarter of the
requests is less than one)."""
DRAFTING_STANDS = 8
"""Steps a decision that drafts stands while the requests and their options are the same
(and no probe is due; `_Settled`). Unlike an all-auto-regressive decision, each of its
steps brings evidence (its trees), which the estimates take in at once; the choice follows
it at most this many steps late (its trees are checked against what it expected of them
only past this many steps, `STAND_Z`: checked from its first step, ReDrafter at batch 8,
T=0 read -2.2% in lockstep, more solves on chance shortfalls; one that rests on sizes barely
measured stands `UNMEASURED_STANDS`). Solved every step, the choice cost ~2% of a drafting
step (sd, T=0: 0.14 ms of ~6.8 at batch 1, 0.30 ms of ~16 at batch 8). At 4 steps, a full solve every ~5 steps still
cost ~2-4% where acceptance is steady (a solve ~0.3-0.5 ms cold on a 2-thread AMD EPYC,
on ~2-5 ms steps): against the best fixed size, in lockstep (16 rounds each, demo engines,
held-out prompts, T=0), 4 -> 8 steps (with `DRAFTING_STANDS_MOST` 64) moved ReDrafter at
batch 1 0.960 -> 0.984, at batch 8 0.951 -> 0.988 (0.941 -> 0.975 in a second run, where
6 steps read 0.962 and 4 with a longer most 0.938) and sd at batch 1 0.960 -> 0.987."""
DRAFTING_STANDS_MOST = 64
"""Steps a decision that drafts stands at most: a solve at the end of its stand that makes
the same decision doubles the next one's, up to this, while its trees yield what it
expected of them (`STAND_Z`, `_Settled.strays`). At batch 1 full solves (new requests and
their last steps included) were ~1/3 of ReDrafter's steps, each ~0.27 ms on a ~1.85 ms
step (2-thread EPYC): ~5% of batch-1 throughput, where fixed chains lost none. 16 before
session 29 (`DRAFTING_STANDS`: 64 alone moved ReDrafter at batch 1 0.960 -> 0.981 of the
best fixed size, at batch 8 nothing)."""
UNMEASURED_STANDS = 4
"""`DRAFTING_STANDS` for a decision that drafts a size measured by fewer than `STAND_TREES`
trees of its kind (`_measured_well`): it rests on optimism, and its trees are not checked
against it before `DRAFTING_STANDS` steps (`STAND_Z`): at batch 1 mostly ReDrafter's wider
beams, which only probes measure, tried on optimism (standing 8 steps, a lockstep run's
first steps at T=1 drafted 8 steps of 21-node trees, each ~3x a plain step). 8 -> 4, in lockstep against the
best fixed size (demo engines, held-out prompts, 16-24 rounds, 2-4 runs a cell): ReDrafter
at batch 1, T=0 +2.0 / +1.5 / +0.9 / +0.7%, sd at batch 1, T=0 +1.5 / +1.4 / +1.1%; at
batch 8, T=0 +2.7 / +0.7 / +0.3 / -0.6%; T=1 cells within +-1% (ReDrafter at batch 1
-0.6 / -0.2 / +0.9 / -0.1%), sd at batch 8, T=1 +2.1 / -1.5%."""
STAND_TREES = 16
"""Trees of its kind each size a decision drafts must rest on before it stands past
`DRAFTING_STANDS` steps (`_measured_well`)."""
STAND_Z = 1.5
"""How many standard deviations the tokens a standing decision's trees yielded may fall
short of what it expected of them before it is solved again (`_Settled.strays`): drafting
more than pays loses throughput at once."""
STAND_Z_OVER = 2.0
"""How many they may exceed it by (drafting less than would pay only forgoes a gain, and
a solve is due within `DRAFTING_STANDS_MOST` steps anyway)."""
STAND_LONGER_Z = 1.0
"""`STAND_Z` for a decision whose stand ran out to be made to stand longer when made again:
while acceptance falls, each solve expects a little less than the last, its trees yield
less still, and doubled stands left synthetic batch-1 runs drafting ~5 steps longer
before they went auto-regressive (`STAND_Z` alone; 2 standard deviations then)."""
SHORT_PATHS = True
"""Steps an all-auto-regressive decision stands for quietly take `choose`'s short path
(`_quiet_step`), and plain steps with nothing to settle `observe`'s (`_observe_plain`): the
same decisions and tables, less host work. False: every step takes the full paths (what
tests and `benchmarks.lockstep` compare against)."""
PLAIN_UNLEARNED_MOST = 256
"""Most plain steps whose timings wait to be learned (`_observe_plain`): an engine serving
only auto-regressive requests solves nothing that would learn them."""
SOLVE_CAUSES = {
    "unsettled": "the solve before settled no decision (a first choice to draft, a probe, a plain probe's run)",
    "tree": "a tree of a size the decision did not give (a probe's) ended it",
    "shape": "a first step of its forward shape at this request count ended it (priced by extrapolation)",
    "expired": "its stand ran out (`DRAFTING_STANDS`, `RECHOOSE_EVERY` and their doublings)",
    "churn": "requests came or went beyond `CHURN_SHARE`, or unlike those it was made for",
    "strays": "its trees yielded less (or more) than it expected (`STAND_Z`)",
    "replaced": "a request with trees of its own took another's place",
    "probe": "a probe came due",
    "fresh": "a fresh request took another's place, its kind's long-run estimate unlike the recent one",
    "staged": "the solve before held requests back from drafting, their catch-up beyond a step's (`CATCH_UP_STAGE`)",
}
"""What ended a decision before a full solve (`SpeculationPolicy.solves`)."""
TreeSums = dict[tuple[Hashable, int], list[float]]
"""(kind, size) -> [tokens, nodes, trees] of a step's trees, summed in their order (`_learn_trees`)."""
Row = tuple[tuple[int, float, float, int, str], ...]
"""One request's options: (size, tau, nodes, levels, drafting-cost fit) per size."""
DraftCall = tuple[int, int, int, int, float]
"""One drafting call of a method, live (`StepStats.drafting`) or timed at engine start
(`Proposer.draft_cost_samples`): (most levels, drafted nodes, tokens caught up,
request-levels: every drafting request's levels summed, seconds)."""
CALIBRATION_SIZES = (1, 2, 3, 5, 8, 12, 17, 24, 33, 48, 64, 128)
"""Forward sizes (tokens) timed at engine start."""
CALIBRATION_ROUNDS = 4
"""Timed forwards of each calibration size in a row (the fastest is kept)."""
AFTER_PREFILL = 4
"""Decoding steps after a heavy step (one that prefilled, or drafted trees) in which a
plain step (one token a request) of several requests teaches the auto-regressive tables
nothing (`observe`). After a stretch of heavy GEMMs a CPU runs the next steps up to ~2x
slower, host work included (2-core Sapphire Rapids, 8 one-token requests after their
prompts' two 40 ms chunks: 4.6, 4.3, 3.6, 3.1, 2.9 ms, then ~2.3-2.5). Every choice pays
that alike after a prefill, but auto-regression, chosen only where drafting does not pay,
was timed in nothing but those steps at batch 8 and priced ~1.6x its steady cost (4.1 ms),
so batches drafted at a loss. The same after tree steps: a plain step amid drafting (a
plain probe, one step) took 3.3-3.5 ms for 8 one-token ReDrafter requests where a run of
them takes ~2.5, and priced so, auto-regression lost to 4-node chains that ran 0.84x it
(load-aware 0.88-0.92x at batch 8 in 3 of 4 sweeps). So a plain probe is a run of
`AFTER_PREFILL` + 1 plain steps whose last one is timed (`_plain_probe`; and the next ones
while its count rests on fewer than `PLAIN_SAMPLES` timings). Steps with trees
still teach theirs (a choice to draft times its own steps every step, in the state its
own run of them leaves the CPU in), and so do plain steps of one request (never probed:
their forward is the calibration's own)."""


@dataclass(slots=True)
class Offer:
    """What one decoding request may draft this step (built for every decoding request every
    step, so not frozen: a frozen dataclass's `__init__` costs ~4x, ~25 us a step at batch 32)."""

    key: str
    """The request (its id)."""
    kind: Hashable
    """Requests whose acceptance is alike (method, greedy): they share estimates."""
    method: str
    """Whose drafting cost it pays."""
    sizes: Sequence[int]
    """Tree sizes it can draft, ascending, starting at 1 (the root alone)."""
    levels: Sequence[int]
    """Sequential drafter calls of each size (0 for size 1)."""
    lag: int = 0
    """Tokens its drafter must read before it drafts (`Proposer.lag`)."""
    left: int | None = None
    """Tokens it may still emit (its `max_tokens` less its output; None: no bound). No step
    yields more, so no tree is expected to: a request 2 tokens from its end gains nothing
    from a 5-node chain over a 3-node one (or, with one token left, over no drafting), and
    priced by the chain's tau it drafted rows that could only be cut off."""
    costs: Sequence[str] = ()
    """Per size, the drafting-cost fit that prices it (`SpeculationPolicy.draft_cost`'s
    key: the method's, or one of its drafting paths' where they cost differently per level,
    `Proposer.cost_paths`); empty: the method's for every size."""
    cuts: int | None = None
    """The largest size up to which each smaller size's tree is the larger tree cut
    (`Proposer.cuts`: ReDrafter's one-beam chains before its beam widths; 0: none); None:
    every size, the largest included."""

    def cut(self, size: int) -> bool:
        """Whether `size` and every smaller size are cuts of one tree (`cuts`): a larger of
        them accepts at least what a smaller one does, and a gain measured inside a larger
        tree is what drafting it gains (`SpeculationPolicy.kind_taus`). Priced as widths,
        ReDrafter's 6-node chain read 3.07-3.33 tokens a step where its own 5-node cut read
        3.19-3.34 (held-out prompts, batch 1), and load-aware drafted 5-node chains in half
        its steps. Not for sizes that are beam widths: a wider search keeps another top beam,
        so each such size is priced by its own measurements."""
        return self.cuts is None or size <= self.cuts

    @property
    def exact(self) -> bool:
        """Every size is a cut of the largest (`cut`): its trees measure every smaller size."""
        return self.cut(self.sizes[-1])


@dataclass(slots=True)
class Outcome:
    """One verified tree."""

    key: str
    kind: Hashable
    size: int
    """The size it was drafted at."""
    sizes: Sequence[int]
    """The sizes the request offered."""
    accepted: int
    """Drafts kept."""
    node_budget: list[int]
    """`DraftTree.node_budget` of every node (empty: only the whole tree is known)."""
    path: list[int]
    """Accepted nodes, root first."""
    nodes: int
    """Tree nodes, root included."""
    cuts: int | None = None
    """`Offer.cuts` of the request (None: every size a cut)."""


@dataclass(slots=True)
class StepStats:
    """Measurements of one step, reported by the engine."""

    num_tokens: int
    forward_seconds: float
    drafting: dict[str, DraftCall] = field(default_factory=dict)
    """Drafting-cost fit (`Offer.costs`: the method, or method/path) -> its drafting call this step."""
    outcomes: list[Outcome] = field(default_factory=list)
    num_requests: int = 1
    """Requests whose tokens the forward held (prefill chunks included)."""
    prefill: bool = False
    """The forward held prefill chunks: their cost (long causal chunks) is not what the
    per-request residual of decoding steps models, so it is not learned from."""
    overhead_seconds: float | None = None
    """The step's seconds beyond the target forward and the drafting calls (their share of
    verification included): scheduling, packing the batch, verifying the roots,
    committing; not the policy's own choice, paid whatever it chooses. Paid once a step
    whatever is drafted (`SpeculationPolicy.overhead`). None: not measured (a step that
    also calibrated the policy)."""
    choose_seconds: float = 0.0
    """The step's `SpeculationPolicy.choose`: a probe is charged the full solves it causes
    (its own step's and the next's, `_settle_probe`)."""

    @property
    def priced_seconds(self) -> float | None:
        """The step's seconds as the policy prices a step: the forward, the drafting calls and
        the host overhead, not its own choice (None: the overhead was not measured)."""
        if self.overhead_seconds is None:
            return None
        return self.forward_seconds + self.overhead_seconds + sum((call[-1] for call in self.drafting.values()), 0.0)


@dataclass(slots=True)
class Estimate:
    tau: float
    nodes: float
    trees: int = 0
    """Trees it was measured on."""
    last: int = 0
    """Step it was last measured at."""
    recent: float = 0.0
    """Its trees as they counted at its last measurement (`weight`)."""
    idle: int = 0
    """`SpeculationPolicy.idle` at its last measurement."""

    def weight(self, idle: int) -> float:
        """The trees behind it as they count against a new measurement once the policy's
        `idle` clock reads `idle`: halved every `KIND_HALF_LIFE` steps without trees since its last."""
        if idle == self.idle:  # no step without trees since: as it counted (the line below, without its power)
            return self.recent
        aged = self.recent * 0.5 ** ((idle - self.idle) / KIND_HALF_LIFE)
        return max(aged, min(self.recent, KIND_LEAST_TREES))


@dataclass(frozen=True, slots=True)
class _Group:
    """`count` requests of one method with the same options and beliefs (`row`)."""

    method: str
    row: Row
    count: int
    catch_up: float = 0.0
    """Tokens its drafters catch up on per step of a steady choice to draft, all together:
    each request's `Offer.lag` spread over the steps its drafting is expected to last
    (`SpeculationPolicy._catch_up`)."""

    def entry(self, size: int) -> tuple[int, float, float, int, str]:
        for e in self.row:
            if e[0] == size:
                return e
        raise KeyError(size)


@dataclass(slots=True)
class _Choice:
    sizes: list[int]
    tokens: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


@dataclass(slots=True)
class _Settled:
    """A decision that stands for a few steps and what it was made for
    (`SpeculationPolicy._settled`; module docstring)."""

    signature: tuple[object, ...]
    """The offers by position (kind, sizes, levels; for a decision that drafts, the bound on
    the tokens a request may still emit where its size is not a chain it can be cut back to,
    `_within`) and the other requests' count."""
    keys: list[str]
    """The requests it stands for, by position (`_standing`: a request with no trees of its
    own may take the place of one that left)."""
    step: int
    """The step it was made at."""
    seconds: float
    """Predicted seconds of such a step (what earns exploration credit)."""
    probe_loss: float | None
    """Expected loss in seconds of the probe that would come next (None: none can come), as
    of the step it was made at."""
    sizes: list[int]
    """Each position's size (all 1: the all-auto-regressive decision)."""
    drafts: bool
    """Whether some request drafts."""
    stands: int = DRAFTING_STANDS
    """Steps it stands: `DRAFTING_STANDS` if it drafts, else `RECHOOSE_EVERY`, doubled each
    time a solve at the end of the one before made it again, up to `DRAFTING_STANDS_MOST`
    (`PLAIN_STANDS_MOST`; `_settle`)."""
    taus: list[float] = field(default_factory=list)
    """Each position's expected tokens per step at its size, as the solve priced it."""
    most: list[float] = field(default_factory=list)
    """Each position's most tokens a step at its size can yield (`ceiling`; 1 at size 1)."""
    chains: list[bool] = field(default_factory=list)
    """Whether each position's size is a chain `_within` may cut (size 1 included)."""
    yields: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """(tokens its trees yielded, tokens they were expected to, a bound on that number's
    variance), summed over its steps in their order (`strays`, `yielded`)."""
    expecting: tuple[float, float] | None = None
    """(tokens, variance bound) the trees of the step under way are expected to yield
    (`give`; None: it drafts none)."""
    given: dict[str, int] = field(default_factory=dict)
    """request -> the size it was given in the step under way (`give`: `_within` may cut a chain)."""
    probe_growth: float = 0.0
    """Seconds that loss grows by each step it stands: the catch-up of that probe's request
    where it drafts nothing (its drafter falls a token further behind each step). Read at
    the loss it was made with, a draft LM's plain decision at batch 8 (sd, T=1) was solved
    afresh for a probe that had grown too dear ~3 times in 5 (each ~0.25 ms)."""
    quiet: tuple[int, int] = (0, 0)
    """An all-auto-regressive decision's quiet stretch (`SpeculationPolicy._quiet`): the
    step before which no probe can come due, and the count of other requests, as of the last
    step it stood for with all its checks (step 0: none yet)."""

    def give(self, offers: list[Offer], cut: bool = True) -> dict[str, int]:
        """Each request's size in a step it stands for, chains cut to what their requests
        may still emit (`_within`; not `cut`: the step that made it, whose sizes the solve
        chose); notes what the step's trees should yield (`expecting`)."""
        if not self.drafts:
            self.given = dict.fromkeys([o.key for o in offers], 1)
            return self.given
        given: dict[str, int] = {}
        tokens = variance = 0.0
        for o, size, tau, most in zip(offers, self.sizes, self.taus, self.most, strict=True):
            if o.left is not None and o.left < most:  # its last tokens: fewer than the tree may yield
                most = float(o.left)
                if cut:
                    size = _within(o, size)
            given[o.key] = size
            if size > 1:
                e = min(tau, most)
                tokens += e
                variance += max(e - 1.0, 0.0) * (most - e) + 0.25
        self.given, self.expecting = given, (tokens, variance)
        return given

    def strays(self, z: float = STAND_Z) -> bool:
        """Whether its trees yielded more than `z` standard deviations less than it expected
        of them, or `STAND_Z_OVER` more (`_standing`: past `DRAFTING_STANDS` steps, a
        decision stands only while its trees bear it out). A request's tokens from a tree
        lie in [1, c], c the most its tree can yield, so a step's variance is at most
        (e - 1)(c - e) for e the tokens expected (Bhatia-Davis), plus a quarter token for
        the estimate's own error."""
        made, expected, variance = self.yields
        spread = variance**0.5
        return made < expected - z * spread or made > expected + STAND_Z_OVER * spread

    def yielded(self, tokens: float) -> None:
        """The step under way's trees yielded `tokens` (`SpeculationPolicy.observe`): into
        `yields` with what they were expected to (`expecting`)."""
        if self.expecting is not None:
            made, expected, variance = self.yields
            self.yields = (made + tokens, expected + self.expecting[0], variance + self.expecting[1])
        self.expecting = None


def _signature(offers: list[Offer], others: int, chains: Sequence[bool] | None = None) -> tuple[object, ...]:
    """What a settled decision was made for: the offers by position, less their requests
    (`_standing` checks them) and `Offer.left`. A request's `left` only shrinks, and a smaller
    one makes its trees worth no more, so auto-regression stays the choice; in the
    signature, it ended the decision at each of a request's last few steps (a fifth of the
    full solves at batch 1). A decision that drafts (`chains`: whether each position's size
    is a chain `_within` cuts back to what its request may still emit) keeps a request's
    `left` where it is under the most tokens its tree can yield and the tree is not such a chain."""
    if chains is None:
        return (others, *((o.kind, o.sizes, o.levels) for o in offers))
    return (
        others,
        *((o.kind, o.sizes, o.levels, None if chain else _bound(o)) for o, chain in zip(offers, chains, strict=True)),
    )


def _first_stand(drafts: bool) -> int:
    """Steps a decision stands before it is made again (`_Settled.stands`): `DRAFTING_STANDS`
    if it drafts, else `RECHOOSE_EVERY`."""
    return DRAFTING_STANDS if drafts else RECHOOSE_EVERY


def _chain(offer: Offer, size: int) -> bool:
    """Whether `offer`'s tree of `size` is a chain (a draft per level) whose smaller sizes are
    its cuts: cut to its first d drafts, it keeps what it would have kept of them."""
    return size == 1 or (offer.cut(size) and offer.levels[offer.sizes.index(size)] == size - 1)


def _within(offer: Offer, size: int) -> int:
    """`size`, or where it is a chain that may yield more tokens than its request may still
    emit (`Offer.left`), the shortest cut of it that still yields every one of them: a chain
    cut to its first d drafts emits min(kept, d) + 1 tokens, so with d + 1 >= left it emits
    what the whole chain would, min(kept + 1, left), with fewer nodes to verify."""
    if offer.left is None or size == 1 or size <= offer.left or not _chain(offer, size):
        return size
    return min(s for s in offer.sizes if offer.left <= s <= size)


def _bound(offer: Offer) -> int | None:
    """`offer.left` where it is under the most tokens its largest tree can yield, else None."""
    return offer.left if offer.left is not None and offer.left <= ceiling(offer, offer.sizes[-1]) else None


@dataclass
class SpeculationPolicy:
    adaptive: bool = True
    """False: every request drafts its largest size (`--speculation fixed`)."""
    forward_cost: ForwardCost = field(default_factory=ForwardCost)
    draft_cost: dict[str, LinearCost] = field(default_factory=dict)
    """method (or method/path, `Offer.costs`) -> seconds of a drafting call from (levels,
    drafted nodes, tokens caught up, request-levels)."""
    kinds: dict[tuple[Hashable, int], Estimate] = field(default_factory=dict)
    """(kind, size) -> estimate shared by requests of that kind."""
    gains: dict[tuple[Hashable, int], Estimate] = field(default_factory=dict)
    """(kind, size) -> tokens per step gained over the next smaller offered size, measured
    in the same trees (`kind_taus`; `nodes` unused)."""
    over: dict[tuple[Hashable, int], Estimate] = field(default_factory=dict)
    """(kind, size) -> for a size above its offer's cuts (`Offer.cuts`: a wider beam, a
    pruned tree), tokens per step its trees yielded over the kind's estimate of the largest
    cut (its chain) when they were drafted (`kind_taus`; `nodes` unused)."""
    long_run: dict[tuple[Hashable, int], Estimate] = field(default_factory=dict)
    """(kind, size) -> estimate over the kind's last ~`LONG_RUN_TREES` trees: a fresh
    request's prior (`_fresh`)."""
    long_gains: dict[tuple[Hashable, int], Estimate] = field(default_factory=dict)
    """`gains` over as many trees."""
    _born: dict[str, int] = field(default_factory=dict)
    """request -> step the policy first priced it (`_fresh`)."""
    requests: dict[str, dict[int, tuple[float, int, int]]] = field(default_factory=dict)
    """request -> size -> its own tau estimate, observations, step of the last one (by
    request first, so that `forget` is one pop: 20,000 requests in flight finish in O(1) each)."""
    chosen: Counter[tuple[str, int]] = field(default_factory=Counter)
    """(method, size) -> request-steps drafted at that size (for reports and metrics)."""
    probes: int = 0
    """Request-steps drafted larger than chosen, to explore."""
    plain_probes: int = 0
    """Steps kept auto-regressive to time a request count's plain step (`_plain_probe`)."""
    credit: float = 0.0
    """Seconds of exploration earned and not spent."""
    futile: int = 0
    """Probes in a row, made while drafting, that did not pay (up to `PROBE_BACKOFF`)."""
    futile_plain: int = 0
    """Probes in a row, made while nothing was drafted, that did not pay (up to `PLAIN_BACKOFF`)."""
    steps: int = 0
    idle: int = 0
    """Steps that drafted no tree: the clock by which the trees behind an estimate age (`KIND_HALF_LIFE`)."""
    since_heavy: int = AFTER_PREFILL + 1
    """Plain decoding steps since the last step that prefilled or drafted trees (`AFTER_PREFILL`)."""
    _plain_left: int = 0
    """Steps of a plain probe's run still to come (`_plain_probe`)."""
    _plain_loss: float = 0.0
    """The expected loss of each step of that run, charged as it comes."""
    _plain_timed: dict[int, int] = field(default_factory=dict)
    """request count -> step its plain step was last learned (`PLAIN_EVERY`)."""
    _plain_probing: bool = False
    """The coming step ends a plain probe's run (`_plain_probe`; its timing counts as `ByRequests.add` says)."""
    _expected: float | None = None
    """Predicted seconds of the coming step (its choice's; None where nothing was chosen)."""
    _bill: tuple[float, float, int, bool] | None = None
    """The coming step's probe, to settle at what it cost (`_settle_probe`): (its expected
    loss, charged; the rate it was weighed against; decoding requests in the step; whether
    the decision it was made in drafts)."""
    _aftermath: int = 0
    """Plain steps after a probe still to settle (`_settle_probe`)."""
    _measured: dict[Hashable, int] = field(default_factory=dict)
    """request (and kind of request) -> step its largest size was last measured or probed."""
    horizons: dict[str, float] = field(default_factory=dict)
    """method -> mean steps its requests' runs of drafting lasted (`CATCH_UP_HORIZON` before any)."""
    _runs: dict[str, tuple[str, int]] = field(default_factory=dict)
    """request -> (method, steps) of the run of drafting it is in (probes not counted)."""
    _ended: list[tuple[str, int]] = field(default_factory=list)
    """(method, steps) of the runs of drafting that ended since the last step (`_fold_runs`)."""
    _settled: _Settled | None = None
    """The standing decision, if any (module docstring)."""
    _expired: _Settled | None = None
    """The settled decision whose stand ran out at this step (`_settle`: made again, it stands longer)."""
    _probed_plain: _Settled | None = None
    """The all-auto-regressive decision a probe ended (`_settle`: made again by the next
    solve, it stands as long as it stood before the probe)."""
    _drafted: bool = False
    """Whether the last full solve chose to draft (`_settle`)."""
    reused: int = 0
    """Steps that reused a settled decision instead of solving again (for tests and reports)."""
    solves: Counter[str] = field(default_factory=Counter)
    """Full solves by what ended the decision before them (`SOLVE_CAUSES`; for reports:
    `benchmarks.policy_replay`, `benchmarks.policy_trace`)."""
    _why: str = "unsettled"
    """Why no decision stands this step (`_standing`; a key of `SOLVE_CAUSES`)."""
    _unsettled: str = "unsettled"
    """Why no decision is settled: the last solve settled none, or `observe` ended it ("tree", "shape")."""
    _unlearned: list[tuple[list[Outcome], dict[str, DraftCall], int, int]] = field(default_factory=list)
    """Steps observed whose trees and drafting calls are not learned yet, in their order
    (`learn`): (verified trees, drafting calls, the step, the `idle` clock then; the
    engine builds each step's lists and trees anew, so they are kept as they are)."""
    _plain_unlearned: list[tuple[int, int, float, float | None]] = field(default_factory=list)
    """Plain steps observed with nothing to settle (`_observe_plain`) whose timings are not
    learned yet, in their order (`learn`): (tokens, requests, forward seconds, host seconds)
    of each."""
    _prices: dict[tuple[int, float, bool], float] | None = None
    """While a full solve runs: (requests, nodes, whether trees) -> seconds of such a step's
    host work and forward (`_evaluate`; the costs do not move within a solve, and its
    uniform choices, probes and Dinkelbach rounds price the same steps again). No change
    measurable at batch 1; ReDrafter at batch 32, full solves 497-582 -> 433-528 us."""
    overhead: ByRequests = field(default_factory=lambda: ByRequests(least_first=True))
    """requests -> least of its first timings, then decayed mean (`ByRequests`), of a decoding step's host seconds
    outside the forward and drafting (`StepStats.overhead_seconds`; `by_requests` between counts, and beyond them
    along the line through the nearest two). Every choice pays it once a step, so it is
    part of each choice's time: left out, goodput compared forwards alone, and at batch 8
    (~1.1 ms of host work on a ~5 ms forward) drafting looked ~15% worse against
    auto-regression than it was. It is mostly per step (~0.5 ms at batch 1, ~1.1 at 8):
    scaled per request from a batch-1 warm-up instead, it priced the first
    auto-regressive steps of 32 ReDrafter requests at 33 ms where they took ~13, and the
    batch drafted 11-node trees: 86 tokens in ~84 ms, where auto-regression makes 32 in ~15.
    Steps without drafting only (`overhead_trees`: steps with trees)."""
    overhead_trees: ByRequests = field(default_factory=ByRequests)
    """The same for steps with trees: packing tree masks, walking the trees, moving the
    accepted paths' KV cost more than a step of roots (Lyanna at batch 8: ~2.5 ms against
    ~0.8). One table for both charged a run of drafting steps' host work to the
    auto-regressive choice, priced it ~35% above what it took, and load-aware Lyanna drafted
    at batch 8 at 0.8x auto-regression. Never below a step of roots' (`overhead_of`)."""

    # ---- estimates ----------------------------------------------------------------------

    def taus(
        self, offer: Offer, kinds: dict[tuple[object, ...], list[float]] | None = None, optimistic: bool = True
    ) -> list[float]:
        """Expected tokens per step of `offer`'s request at each of its sizes: its kind's
        estimates (`kind_taus`, `optimistic` or not) shifted by what its own trees show beyond
        chance (`_shift`), never less at a larger size than at a smaller one where smaller
        trees are cuts of larger ones (`Offer.exact`: the larger holds the smaller's accepted
        path). A fresh request's kind estimates lean to the kind's long-run ones (`_fresh`).
        `kinds`: the kind estimates already worked out this step (a batch is mostly one kind)."""
        self.learn()
        shared_taus = self._kind_row(offer, kinds, optimistic)
        if fresh := self._fresh(offer.key):
            long_run = self._kind_row(offer, kinds, optimistic, long_run=True)
            shared_taus = [t + fresh * (t_long - t) for t, t_long in zip(shared_taus, long_run, strict=True)]
        out: list[float] = []
        floor, shift = 1.0, 0.0
        for size, shared in zip(offer.sizes, shared_taus, strict=True):
            if size == 1:
                out.append(1.0)
                continue
            own = self._shift(offer.key, size, shared)
            if own is None and not offer.cut(size):  # a wider beam it never drafted: as its largest drafted size
                value = min(shared + shift, ceiling(offer, size))
            else:
                value = shared + (own or 0.0)
            shift = shift if own is None else own
            if (offer.kind, size) not in self.kinds:  # never measured: no floor above
                out.append(max(value, floor))
                continue
            if offer.cut(size):  # a cut of a larger tree: the larger accepts at least as much
                value = floor = max(floor, value)
            out.append(value)
        return out

    def _kind_row(
        self,
        offer: Offer,
        kinds: dict[tuple[object, ...], list[float]] | None,
        optimistic: bool,
        long_run: bool = False,
    ) -> list[float]:
        """`kind_taus`, worked out once a step per kind and options where `kinds` holds them."""
        if kinds is None:
            return self.kind_taus(offer, optimistic, long_run)
        key = (offer.kind, tuple(offer.sizes), tuple(offer.levels), offer.cuts, optimistic, long_run)
        if key not in kinds:
            kinds[key] = self.kind_taus(offer, optimistic, long_run)
        return kinds[key]

    def _fresh(self, key: str) -> float:
        """The weight of its kind's long-run estimates (`long_run`) in the row of request
        `key`, against the recent ones: `FRESH_STEPS` / (`FRESH_STEPS` + n) n steps after the
        policy first priced it (n rounded down to a power of two; none from 4 x `FRESH_STEPS`
        on). Shrinkage to the mean of many requests, not of the last one: at batch 1 the
        recent estimate is the request before. By steps, not by its own trees: a request of a
        batch that drafts nothing measures a tree every few hundred steps (its probes), and
        priced by the long run for as long, a batch of 8 whose acceptance rose stayed
        auto-regressive on the estimate of the poor stretch before."""
        n = self.steps - self._born.setdefault(key, self.steps)
        if n >= 4 * FRESH_STEPS:
            return 0.0
        n = 1 << (n.bit_length() - 1) if n else 0
        return FRESH_STEPS / (FRESH_STEPS + n)

    def _fresh_apart(self, offer: Offer) -> bool:
        """Whether fresh request `offer`'s row stands apart from its kind's recent one: its
        long-run estimates differ from the recent ones by more than `FRESH_SHIFT` at some size."""
        recent, long_run = self.kind_taus(offer, False), self.kind_taus(offer, False, long_run=True)
        return any(abs(a - b) > FRESH_SHIFT for a, b in zip(recent, long_run, strict=True))

    def _shifted(self, offer: Offer, kinds: dict[tuple[object, ...], list[float]], optimistic: bool) -> bool:
        """Whether `offer`'s request has an own estimate that moves its kind's (`_shift` not
        0: beyond chance). If none does, `taus` gives it its kind's values exactly (an own
        estimate within the noise shifts by 0, as no estimate does), so its row is the
        shared one (`_solve`). 70-90% of the requests with trees of their own shift by 0 in
        every size (ReDrafter, sd, rsd-s at batch 4 and 16, T=0 and 1, held-out prompts);
        ReDrafter's full solves at batch 32 under cProfile went 1.2 -> 0.9 ms."""
        own = self.requests.get(offer.key)
        if not own:
            return False
        for size, shared in zip(offer.sizes, self._kind_row(offer, kinds, optimistic), strict=True):
            if size > 1 and size in own and self._shift(offer.key, size, shared):
                return True
        return False

    def kind_taus(self, offer: Offer, optimistic: bool = True, long_run: bool = False) -> list[float]:
        """The estimates of `offer`'s kind at each of its sizes. The smallest drafted size:
        its measured mean; each larger one: the next smaller one's estimate plus the mean gain
        over it measured in the same trees (`gains`), so that sizes drafted more rarely
        (measured only by trees at least as large) are not compared level against level
        with fresher smaller ones: measured apart, 4- and 5-node chains of sd at T=1, batch
        1 read 2.0-2.25 tokens from a few probes where 3-node chains read 2.4 from many,
        and the policy drafted 2- and 3-node chains (1.47x auto-regression where 5-node
        chains throughout ran 1.67x). A size's own mean still counts where it is higher
        (optimism: a size priced too high is drafted and measured at once, one priced too
        low only when probed). Each estimate is optimistic while it rests on few trees
        (`KIND_PRIOR` trees' worth of the `ceiling`; for a gain, of one more token, within
        the ceiling); a size never measured is the next smaller size's estimate plus one
        token, within its ceiling (the smallest drafted size: its ceiling). Not `optimistic`
        (`EXPLORERS`): pessimistic the same way, `KIND_PRIOR` trees' worth of the next smaller
        size's estimate (a gain: of none; the smallest drafted size: its mean, 1 token before
        any), so that a size never measured is worth no more than the next smaller one.
        `long_run`: of the kind's long-run estimates (`long_run`, `long_gains`; the recent
        ones where it has none)."""
        self.learn()
        out: list[float] = []
        below: float | None = None  # the estimate of the next smaller drafted size
        chain: float | None = None  # the estimate of the largest cut (`Offer.cuts`), where larger sizes are not cuts
        for size in offer.sizes:
            if size == 1:
                out.append(1.0)
                continue
            most = ceiling(offer, size)
            measured = self._estimate(self.kinds, self.long_run, (offer.kind, size), long_run)
            if measured is None and below is not None:
                # never measured, but a smaller size was: one more token. So also where sizes
                # are not cuts (beam widths): at the ceiling (every level accepted), a whole
                # batch of 18 ReDrafter requests drafted its first 11-node trees (~30 ms a step
                # where auto-regression takes ~6) where one probe would have measured them
                most = min(most, below + 1.0)
            over = self.over.get((offer.kind, size)) if chain is not None else None
            if OVER_CHAIN and chain is not None and below is not None and over is not None:
                # above the cuts, measured by probes now and then: priced over the chain as
                # it reads now (`OVER_CHAIN`)
                value = chain + (_optimistic(over, most - chain) if optimistic else _pessimistic(over, below - chain))
            elif optimistic:
                value = _optimistic(measured, most)
            elif below is None:  # the smallest drafted size: every tree measures it
                value = measured.tau if measured is not None else 1.0
            else:
                value = _pessimistic(measured, below)
            gain = (
                self._estimate(self.gains, self.long_gains, (offer.kind, size), long_run)
                if below is not None and offer.cut(size)
                else None
            )
            if below is not None and gain is not None:
                value = max(
                    value,
                    below + (_optimistic(gain, min(most - below, 1.0)) if optimistic else _pessimistic(gain, 0.0)),
                )
            out.append(value)
            below = value
            if size == offer.cuts and size < offer.sizes[-1]:
                chain = value
        return out

    @staticmethod
    def _estimate(
        recent: dict[tuple[Hashable, int], Estimate],
        long: dict[tuple[Hashable, int], Estimate],
        key: tuple[Hashable, int],
        long_run: bool,
    ) -> Estimate | None:
        """`key`'s estimate: the `long` one where `long_run` and there is one, else the `recent` one."""
        return (long_run and long.get(key)) or recent.get(key)

    def _shift(self, key: str, size: int, shared: float) -> float | None:
        """How far request `key`'s own estimate at `size` moves its kind's (`shared`): by
        what exceeds the chance spread of its trees, weighted by their number and age
        (module docstring); None if it drafted no tree of `size` (`taus` then takes, for a
        size that is not a cut of the smaller ones, the shift of its largest smaller drafted
        size: a text hard for its chains is hard for its wider beams too. Unshifted, a
        request whose own 6-node chains made 1.5 tokens a step where its kind's made 3.1
        priced ReDrafter's 11-node beams at its kind's 4.0, and drafted them: 5 steps at
        ~4.2 ms where its chains took ~2.7, a few times a prompt, at batch 1. Carried to the
        cuts of a drafted tree as well, sd at T=1 went auto-regressive in ~40% of its batch-1
        steps: 1.21x where it ran 1.30x)."""
        own = self.requests.get(key, {}).get(size)
        if own is None:
            return None
        tau, n, last = own
        noise = REQUEST_NOISE * max(1.0, (REQUEST_PRIOR / n) ** 0.5)  # the spread of a mean of n trees
        excess = abs(tau - shared) - noise  # only what exceeds it counts
        if excess <= 0:
            return 0.0
        weight = n / (n + REQUEST_PRIOR) * 0.5 ** ((self.steps - last) / REQUEST_HALF_LIFE)
        return weight * (excess if tau > shared else -excess)

    def nodes(self, offer: Offer, size: int) -> float:
        shared = self.kinds.get((offer.kind, size)) if size > 1 else None
        return shared.nodes if shared is not None else float(size)

    def estimates(self) -> dict[str, dict[int, float]]:
        """kind -> size -> measured tokens per step (the decayed mean, before `KIND_PRIOR`; for
        reports), as of the last `learn`: a front end's thread reads it while the engine's
        steps (`LLMEngine.stats`), so it learns nothing itself (a few steps behind while a
        decision stands; all of them once the requests left)."""
        out: dict[str, dict[int, float]] = {}
        for (kind, size), e in sorted(self.kinds.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            out.setdefault(_kind_name(kind), {})[size] = round(e.tau, 3)
        return out

    # ---- choice -------------------------------------------------------------------------

    def choose(self, offers: list[Offer], others: int = 0) -> dict[str, int]:
        """Each decoding request's size this step; `others` (prefilling) requests add ~1
        token each to the forward."""
        if (quiet := self._quiet_step(offers, others)) is not None:
            return quiet
        self.steps += 1
        self._expected = None
        if self._ended:
            self._fold_runs()
        # auto-regressive requests, and (load-aware) those with one token left, which no tree yields more of
        last = 1 if self.adaptive else 0
        fixed: dict[str, int] = {}
        rest: list[Offer] = []
        for o in offers:  # (one pass: this and the counting below are most of a standing step's choice)
            if len(o.sizes) == 1:
                fixed[o.key] = 1
            elif o.left is not None and o.left <= last:
                fixed[o.key] = 1
                self.chosen[(o.method, 1)] += 1
            else:
                rest.append(o)
        offers = rest
        if not offers:
            return fixed
        prefilling = others
        others += len(fixed)  # their one token each is in the forward
        probed, plain, roots = None, False, False  # roots: every request at size 1
        if not self.adaptive:
            chosen = {o.key: o.sizes[-1] for o in offers}
        elif self._plain_left > 0:  # a plain probe's run goes on (`_plain_probe`)
            self._plain_left -= 1
            self.credit -= self._plain_loss
            self._plain_probing = self._plain_left == 0
            chosen, plain, roots = {o.key: 1 for o in offers}, True, True
        elif (standing := self._standing(offers, others)) is not None:
            chosen, roots = standing.give(offers), not standing.drafts
            self._expected = standing.seconds
        else:
            self.solves[self._why] += 1
            self._prices = {}
            try:
                chosen, probed, plain = self._solve(offers, others, prefilling, fixed)
            finally:
                self._prices = None
        if roots:  # counted per method; every run of drafting ends (none does in a probe's plain run)
            per_method: dict[str, int] = {}  # (a dict: a Counter's ABC checks cost ~2 us a step with cold caches)
            for o in offers:
                per_method[o.method] = per_method.get(o.method, 0) + 1
            for method, n in per_method.items():
                self.chosen[(method, 1)] += n
            if not plain and self._runs:
                for o in offers:
                    self._end_run(o.key)
            return fixed | chosen
        for o in offers:
            self.chosen[(o.method, chosen[o.key])] += 1
            if plain:
                continue
            if chosen[o.key] == 1:
                self._end_run(o.key)
            elif o.key != probed or o.key in self._runs:  # a probe alone is no run
                self._runs[o.key] = (o.method, self._runs.get(o.key, (o.method, 0))[1] + 1)
        return fixed | chosen

    def _solve(
        self, offers: list[Offer], others: int, prefilling: int, fixed: dict[str, int]
    ) -> tuple[dict[str, int], str | None, bool]:
        """A full solve (`choose`): each request's size, the request probed (if any), and
        whether the step is a plain probe."""
        self.learn()
        probed, plain = None, False
        # requests with the same options and beliefs (most of a batch) are decided together
        groups: dict[tuple[str, Row], list[Offer]] = {}
        kinds: dict[tuple[object, ...], list[float]] = {}
        # a request with no trees of its own, or none that move its kind's estimates
        # (`_shifted`), has its kind's row: worked out once a step for them all (per
        # request, the rows were ~60% of a full solve at batch 32)
        shared: dict[tuple[object, ...], Row] = {}
        explorers: Counter[Hashable] = Counter()  # requests of each kind priced optimistically so far
        for o in offers:
            optimistic = explorers[o.kind] < EXPLORERS
            explorers[o.kind] += optimistic
            key = (
                None
                if self._shifted(o, kinds, optimistic)
                else (
                    o.method,
                    o.kind,
                    tuple(o.sizes),
                    tuple(o.levels),
                    o.cuts,
                    tuple(o.costs),
                    _bound(o),
                    optimistic,
                    self._fresh(o.key),
                )
            )
            row = shared.get(key) if key is not None else None
            if row is None:
                most = float("inf") if o.left is None else o.left
                taus = self.taus(o, kinds, optimistic)
                row = tuple(
                    (s, min(tau, most), self.nodes(o, s), lv, cost)
                    for s, tau, lv, cost in zip(o.sizes, taus, o.levels, costs(o), strict=True)
                )
                if key is not None:
                    shared[key] = row
            groups.setdefault((o.method, row), []).append(o)
        batch = [
            _Group(m, row, len(members), sum((self._catch_up(o, row) for o in members), 0.0))
            for (m, row), members in groups.items()
        ]
        best = self._best(batch, others)
        chosen = {o.key: size for (_, members), size in zip(groups.items(), best.sizes, strict=True) for o in members}
        self._expected = best.seconds
        members, drafting = list(groups.values()), max(best.sizes) > 1
        candidate = self._probe(members, batch, others, best)  # among kinds not measured lately
        probe = self._explore(candidate, best, drafting)
        if probe is not None:
            offer, size, loss = probe
            chosen[offer.key], probed = size, offer.key
            self._bill = (loss, best.rate, len(offers) + len(fixed), drafting)
        elif not prefilling and self._plain_probe(batch, others, best):
            chosen, plain = dict.fromkeys(chosen, 1), True  # a probe too: no run ends, nothing settles
        if probe is not None and self._settled is not None and not self._settled.drafts:
            self._probed_plain = self._settled  # ended by its probe, not by what it was made for
        self._settled, expired, self._expired = None, self._expired, None
        self._unsettled = "unsettled"
        if probe is None and not plain:
            if self._stage(offers, chosen, batch, others):  # the rest start in the next steps: solved again
                self._drafted, self._probed_plain, self._unsettled = True, None, "staged"
            else:
                self._settle(members, batch, others, best, offers, chosen, expired, candidate)
        return chosen, probed, plain

    def _stage(self, offers: list[Offer], chosen: dict[str, int], batch: list[_Group], others: int) -> bool:
        """Hold back (size 1 in `chosen`) the requests a choice to draft starts beyond this
        step's share of catch-up (`CATCH_UP_STAGE` plain steps of the batch, at the
        drafters' per-token slopes), the least behind first, the first always; whether
        any was held back. Requests already caught up draft as chosen."""
        starting = sorted((o for o in offers if o.lag and chosen[o.key] > 1), key=lambda o: o.lag)
        if len(starting) < 2:
            return False
        budget = CATCH_UP_STAGE * self._evaluate(batch, [1] * len(batch), others).seconds
        spent, held = 0.0, False
        for k, o in enumerate(starting):
            spent += self._token_read(o, chosen[o.key]) * o.lag
            if k and spent > budget:
                chosen[o.key], held = 1, True
        return held

    def _best(self, batch: list[_Group], others: int) -> _Choice:
        """The best of every uniform choice and a few Dinkelbach rounds (none for one group:
        its uniform choices are all its choices)."""
        sizes = [[e[0] for e in g.row] for g in batch]
        uniform = sorted({s for offered in sizes for s in offered})
        best = max(
            # each group's largest size within c (sizes ascend from 1: `largest_fitting`)
            (
                self._evaluate(batch, [offered[bisect.bisect(offered, c) - 1] for offered in sizes], others)
                for c in uniform
            ),
            key=lambda c: c.rate,
        )
        if len(batch) == 1:
            return best
        requests = sum(g.count for g in batch)
        lo = others + requests
        hi = others + sum((g.count * g.row[-1][2] for g in batch), 0.0)
        fslope = self.forward_cost.slope(lo, hi)
        per_fit: Counter[str] = Counter()  # requests that may pay each drafting-cost fit
        for g in batch:
            for cost in {e[4] for e in g.row}:
                per_fit[cost] += g.count
        slopes = {cost: self._draft_slopes(cost, n) for cost, n in per_fit.items()}
        rate = best.rate
        for _ in range(DINKELBACH_ROUNDS):
            picks = [_pick(g, rate, fslope, slopes) for g in batch]
            cand = self._evaluate(batch, picks, others)
            if cand.rate > best.rate:
                best = cand
            if cand.rate <= rate:
                break
            rate = cand.rate
        return best

    def _explore(
        self, candidate: tuple[Offer, int, float] | None, best: _Choice, drafting: bool
    ) -> tuple[Offer, int, float] | None:
        """Spend the exploration credit on the probe `candidate` (`_probe`) when it covers
        the expected loss (`drafting`: whether `best` drafts, `_earned`); returns the request
        to probe, the size it drafts and the loss charged (or None)."""
        if candidate is None:
            self.credit = self._earned(best.seconds, None, drafting)
            return None
        offer, size, loss = candidate
        self.credit = self._earned(best.seconds, loss, drafting)
        if loss > self.credit:
            return None
        self._measured[offer.kind] = self.steps
        self.credit -= max(loss, 0.0)
        self.probes += 1
        return offer, size, max(loss, 0.0)

    def _plain_probe(self, batch: list[_Group], others: int, best: _Choice) -> bool:
        """Whether this step starts a plain probe instead of drafting `best`: a run of
        `AFTER_PREFILL` + 1 plain steps whose last one times the plain step of this request
        count (after a tree step the next ones run slow: `AFTER_PREFILL`), paid from the
        exploration credit like any probe (a step's expected loss to start, each later
        step's as it comes: the credit may go below zero, and the probes after wait), while
        that price rests on fewer than `PLAIN_SAMPLES` timings (`ByRequests.seen` of its
        forward residual; its host overhead is timed in the same steps), and again once it
        was last timed `PLAIN_EVERY` steps ago. Until then it is extrapolated from other
        counts or from a batch's first, slow steps, and a price set too high is never
        corrected by a choice that then never picks it: on a 2-core Sapphire Rapids a batch
        of 8 sd requests at T=1, warmed up at batch 1, priced its auto-regressive step at
        4.4 ms (the overhead's line through 1 and 2 requests) where it took ~2.6, drafted
        3-node chains at 2.25 tokens/ms for the whole run where auto-regression makes ~3,
        and ran 0.74x auto-regression. Never for one request: its plain forward is the
        engine-start table's own (timed on one request). The run goes on for as many steps
        more as the count lacks timings of `PLAIN_SAMPLES` (its later steps are timed alike):
        one timing a run, ReDrafter at batch 8, T=0 ran 9 plain probes in 12 rounds of 64
        tokens, ~12% of its steps plain where 4-node chains made ~1.5x the tokens per second."""
        requests = others + sum(g.count for g in batch)
        if max(best.sizes) == 1 or not self._plain_untimed(requests):
            return False
        plain = self._evaluate(batch, [1] * len(batch), others)
        loss = plain.seconds - plain.tokens / max(best.rate, 1e-12)  # a step's
        if loss > self.credit:
            return False
        run = self._plain_run(requests)
        self.credit -= max(loss, 0.0)
        self.plain_probes += 1
        self._plain_left, self._plain_loss = run - 1, max(loss, 0.0)
        self._plain_probing = run == 1
        return True

    def _plain_run(self, requests: int) -> int:
        """Steps of a plain probe's run at `requests` requests (`_plain_probe`): until one is
        timed (`AFTER_PREFILL` after the last step that prefilled or drafted trees), then one
        more for each other timing the count lacks (`PLAIN_SAMPLES`)."""
        missing = max(step_costs.PLAIN_SAMPLES - self.forward_cost.extra.seen[requests], 1)
        return AFTER_PREFILL + 1 - min(self.since_heavy, AFTER_PREFILL) + missing - 1

    def _plain_untimed(self, requests: int) -> bool:
        """Whether the plain step of `requests` requests is priced on fewer than
        `PLAIN_SAMPLES` timings or was last timed `PLAIN_EVERY` steps ago, and no larger
        count was (`_plain_fresh`: below one, it is priced by the line between it and the
        next smaller count, or one request, whose plain step is always known, not by
        extrapolation). Never for one request (`_plain_probe`). Each count timed on its own,
        a closed batch of 8 rsd-c requests at T=0 ran a plain probe (5 plain steps where
        5-node chains made ~1.5x the tokens per second) at each count it shrank through,
        ~10% of its steps: 0.94x auto-regression."""
        if self._plain_fresh(requests):
            return False
        return not any(count > requests and self._plain_fresh(count) for count in self._plain_timed)

    def _plain_fresh(self, requests: int) -> bool:
        """Whether the plain step of `requests` requests is priced on `PLAIN_SAMPLES` timings
        or more, the last of them less than `PLAIN_EVERY` steps ago (one request: always)."""
        if requests == 1:
            return True
        timed = self.forward_cost.extra.seen[requests] >= step_costs.PLAIN_SAMPLES
        return timed and self.steps - self._plain_timed.get(requests, self.steps) < PLAIN_EVERY

    def _probe(
        self, members: list[list[Offer]], batch: list[_Group], others: int, best: _Choice, stale_only: bool = True
    ) -> tuple[Offer, int, float] | None:
        """The request a probe would be for (the one measured longest ago, among kinds not
        measured for `PROBE_EVERY` steps unless `stale_only` is False), the size it would
        draft (`_probe_size`) and the probe's expected loss in seconds; None if no request
        can probe."""
        stale = self.steps - PROBE_EVERY
        candidates = sorted(  # stable: of equal keys, the first in the batch, as `min` would take
            (
                (i, o)
                for i, group in enumerate(members)
                for o in group
                if not stale_only or self._measured.get(o.kind, -1) <= stale
            ),
            key=lambda c: (c[1].lag, self._measured.get(c[1].key, -1)),
        )
        # the first that has a size to probe (`_probe_size` only until then: asked of every
        # request, twice a solve, ReDrafter's full solves at batch 32 took 0.39-0.47 ms, 0.31-0.33 now)
        found = next(((i, o, s) for i, o in candidates if (s := self._probe_size(o, best.sizes[i])) is not None), None)
        if found is None:
            return None
        i, offer, size = found
        g = batch[i]
        probing = [*batch, _Group(g.method, g.row, 1)]  # its catch-up is charged in full below
        probing[i] = _Group(g.method, g.row, g.count - 1, g.catch_up - self._catch_up(offer, g.row))

        def trial(s: int) -> _Choice:
            return self._evaluate(probing, [*best.sizes, s], others)

        if offer.exact and best.sizes[i] == 1 and PROBE_BEST_WHILE_PLAIN:
            # drafting nothing, does drafting pay at all? (`PROBE_BEST_WHILE_PLAIN`)
            probe, size = max(((trial(s), s) for s in offer.sizes if s > 1), key=lambda t: (t[0].rate, t[1]))
        else:
            probe = trial(size)
        catch_up = self._token_read(offer, size) * offer.lag
        return offer, size, probe.seconds + catch_up - probe.tokens / max(best.rate, 1e-12)

    def _probe_size(self, offer: Offer, chosen: int) -> int | None:
        """The size a probe of `offer` drafts instead of `chosen`: its largest, which
        measures every smaller size where they are cuts of it (`Offer.exact`; while the
        request drafts nothing, `_probe` drafts its best size: `PROBE_BEST_WHILE_PLAIN`);
        while it drafts nothing, its largest cut where only smaller sizes are cuts
        (`PROBE_CHAINS_WHILE_PLAIN`); else the size its kind measured longest ago (the
        larger of a tie: a chain measures the shorter chains in it), so that every size is
        measured in turn. Measured only when
        drafted, rsd-s's chains kept the estimate of a few unlucky first chains (2.3 tokens
        a step at T=1, batch 1, where they make ~3.1) while its 9-node beams were chosen
        and re-measured, and load-aware rsd-s ran 1.45x auto-regression where chains ran
        1.76x. None: nothing to probe."""
        if offer.exact:
            return offer.sizes[-1] if chosen < offer.sizes[-1] else None
        if PROBE_CHAINS_WHILE_PLAIN and chosen == 1 and offer.cuts is not None and offer.cuts > 1:
            return largest_fitting(offer.sizes, offer.cuts)
        sizes = [s for s in offer.sizes if s > 1 and s != chosen]
        if not sizes:
            return None
        return min(sizes, key=lambda s: (e.last if (e := self.kinds.get((offer.kind, s))) else -1, -s))

    def _settle(
        self,
        members: list[list[Offer]],
        batch: list[_Group],
        others: int,
        best: _Choice,
        offers: list[Offer],
        chosen: dict[str, int],
        expired: _Settled | None,
        candidate: tuple[Offer, int, float] | None,
    ) -> None:
        """Let the decision just solved (`best`, no probe in it) stand for the next steps
        (`_standing`). An all-auto-regressive one only while a probe can still come (one that
        cannot would never be ended by one); one that drafts only where the solve before
        chose to draft too: a first choice to draft after auto-regression often rests on
        optimism about sizes barely measured, and its first trees should end it (standing at
        once, a batch of 8 drafted 4 steps of rejected trees in the synthetic worlds of the
        tests: 0.965x auto-regression where solving every step made 0.978x). `expired`: the
        decision whose stand ran out at this step, if any (made again, the new one stands longer);
        `candidate`: the probe a kind not measured lately would make now (`_probe`), if any."""
        drafts = max(best.sizes) > 1
        confirmed, self._drafted = self._drafted, drafts
        probed, self._probed_plain = self._probed_plain, None
        if drafts and not confirmed:
            return  # a first choice to draft (optimism about sizes barely measured): its trees may end it
        # the probe that would come next: the one a kind not measured lately has now, else
        # the first once one is (worked out once: a solve asked `_probe` twice)
        next_probe = candidate or self._probe(members, batch, others, best, stale_only=False)
        if next_probe is None and not drafts:
            return
        loss = next_probe[2] if next_probe is not None else None
        sizes = [chosen[o.key] for o in offers]
        chains = [_chain(o, size) for o, size in zip(offers, sizes, strict=True)]
        signature = _signature(offers, others, chains if drafts else None)
        stands = _first_stand(drafts)
        if PROBE_KEEPS_STAND and not drafts and probed is not None and probed.signature == signature:
            stands = probed.stands  # made again after a probe ended it
        measured = not drafts or self._measured_well(offers, sizes)
        if expired is not None and expired.sizes == sizes:  # made again at the end of its stand
            if not drafts:
                stands = min(2 * expired.stands, PLAIN_STANDS_MOST)
            # past `DRAFTING_STANDS` steps only on sizes measured well, and while no plain probe
            # is due (`_plain_untimed`: what it would correct is a price, which no tree shows)
            elif measured and not expired.strays(STAND_LONGER_Z) and not self._plain_untimed(others + len(offers)):
                stands = min(2 * expired.stands, DRAFTING_STANDS_MOST)
        if not measured:
            stands = min(stands, UNMEASURED_STANDS)
        taus = {o.key: g.entry(s)[1] for g, s, group in zip(batch, best.sizes, members, strict=True) for o in group}
        self._settled = _Settled(
            signature,
            [o.key for o in offers],
            self.steps,
            best.seconds,
            loss,
            sizes,
            drafts,
            stands,
            [taus[o.key] for o in offers],
            [ceiling(o, size) for o, size in zip(offers, sizes, strict=True)],
            chains,
            probe_growth=self._probe_growth(next_probe, chosen),
        )
        self._settled.give(offers, cut=False)  # what this step gives and expects

    def _probe_growth(self, probe: tuple[Offer, int, float] | None, chosen: dict[str, int]) -> float:
        """Seconds the expected loss of `probe` (`_probe`) grows by each step its request
        drafts nothing (`chosen`): its catch-up of one token more (`_Settled.probe_growth`)."""
        if probe is None or not probe[0].lag or chosen[probe[0].key] > 1:
            return 0.0
        return self._token_read(probe[0], probe[1])

    def _token_read(self, offer: Offer, size: int) -> float:
        """Seconds `offer`'s drafter takes to catch up on one token before it drafts `size`
        (the per-token slope of that size's drafting-cost fit)."""
        return self._draft_slopes(costs(offer)[offer.sizes.index(size)], 1)[2]

    def _measured_well(self, offers: list[Offer], sizes: list[int]) -> bool:
        """Whether each size a decision drafts is measured by `STAND_TREES` trees of its kind:
        only then may it stand past `DRAFTING_STANDS` steps (`_settle`), and otherwise it
        stands `UNMEASURED_STANDS`. A choice that rests on optimism about a size barely
        measured must meet its trees soon: standing long, a batch-1 ReDrafter request drafted
        21-node trees priced at 4.8 tokens on one tree, ~15% of its steps at ~1.5x a chain's cost."""
        for o, size in zip(offers, sizes, strict=True):
            if size > 1 and ((e := self.kinds.get((o.kind, size))) is None or e.trees < STAND_TREES):
                return False
        return True

    def _standing(self, offers: list[Offer], others: int) -> _Settled | None:
        """The settled decision if it holds for this step (module docstring); if it does,
        the step earns its exploration credit here. A request with no trees of its own may
        stand in the place of one that left (a new request, at batch 1 after the step that
        prefilled it): it is priced as its kind, and is for at most `DRAFTING_STANDS` steps
        more (`RECHOOSE_EVERY` in an all-auto-regressive decision)."""
        s = self._settled
        if s is None:
            self._why = self._unsettled
            return None
        age = self.steps - s.step
        if age >= s.stands:
            self._expired, self._why = s, "expired"
            return None
        if self._quiet(s, offers, others):  # (no kind is measured while it stands: `_Settled.quiet`)
            if (credit := self._stand_credit(s, age, self.steps >= s.quiet[0])) is None:
                self._why = "probe"
                return None  # a probe is due: solve this step in full
            self.credit = credit
            self.reused += 1
            return s
        keys = [o.key for o in offers]
        replaced = keys != s.keys
        # the same requests (their kinds and options frozen) with as many others: the
        # signature of an auto-regressive decision, or of one whose every size is a chain (no
        # bound on what a request may still emit in it), holds without building it (~25 us at
        # batch 32)
        same = not replaced and others == s.signature[0] and (not s.drafts or all(s.chains))
        if not same and (
            len(offers) != len(s.keys) or _signature(offers, others, s.chains if s.drafts else None) != s.signature
        ):
            if (places := self._churned(s, offers, others)) is None:
                self._why = "churn"
                return None
            self._rebase(s, offers, others, places)
            replaced = False
            s.stands = min(s.stands, age + _first_stand(s.drafts))
        if s.drafts and age >= DRAFTING_STANDS and s.strays():
            self._why = "strays"
            return None  # its trees do not bear it out: solve afresh
        if replaced and any(o != k and o in self.requests for o, k in zip(keys, s.keys, strict=True)):
            self._why = "replaced"
            return None
        if replaced and any(o.key != k and self._fresh_apart(o) for o, k in zip(offers, s.keys, strict=True)):
            self._why = "fresh"  # priced as the requests before it, where its prior is unlike them
            return None
        stale = self.steps - PROBE_EVERY
        can_probe = any(self._measured.get(o.kind, -1) <= stale for o in offers)
        if (credit := self._stand_credit(s, age, can_probe)) is None:
            self._why = "probe"
            return None  # a probe is due: solve this step in full
        if replaced:
            s.keys = keys
            s.stands = min(s.stands, age + _first_stand(s.drafts))
        if not s.drafts:  # no probe can come due before a kind's last measurement is `PROBE_EVERY` steps old
            s.quiet = (min(self._measured.get(o.kind, -1) for o in offers) + PROBE_EVERY, others)
        self.credit = credit
        self.reused += 1
        return s

    def _churned(self, s: _Settled, offers: list[Offer], others: int) -> list[int] | None:
        """Where in `s` each of `offers` stands though requests came or went (`CHURN_SHARE`),
        or None where `s` does not stand for them: as many requests in the step give or take
        that share of those it was made for; a request it was made for stands in its own
        place, as it was made for (in a decision that drafts, with the same bound on what it
        may still emit); one it was not made for is fresh (no trees of its own) and stands in
        the place of the first request of its kind and options (in a decision that drafts, one
        whose size no bound changes), at that one's size."""
        others_then = cast(int, s.signature[0])
        made_for = len(s.keys) + others_then
        if abs(len(offers) + others - made_for) + abs(others - others_then) > CHURN_SHARE * made_for:
            return None
        position = {k: i for i, k in enumerate(s.keys)}
        entries = s.signature[1:]
        places = []
        for o in offers:
            i = position.get(o.key)
            if i is not None:
                if s.drafts and entries[i] != (o.kind, o.sizes, o.levels, None if s.chains[i] else _bound(o)):
                    return None
            elif o.key in self.requests:
                return None
            else:
                i = next(
                    (
                        j
                        for j, e in enumerate(entries)
                        if e[:3] == (o.kind, o.sizes, o.levels)  # type: ignore[index]
                        and (not s.drafts or s.chains[j] or _bound(o) is None)
                    ),
                    None,
                )
                if i is None:
                    return None
            places.append(i)
        return places

    def _rebase(self, s: _Settled, offers: list[Offer], others: int, places: list[int]) -> None:
        """`s` made for `offers` and `others`, each request at the size of its place in it
        (`_churned`), priced as a step of theirs (what exploration's credit, a probe's
        aftermath and the trees' expectations read)."""
        self.learn()
        s.keys = [o.key for o in offers]
        s.sizes = [s.sizes[i] for i in places]
        if s.drafts:
            s.taus, s.most = [s.taus[i] for i in places], [s.most[i] for i in places]
            s.chains = [s.chains[i] for i in places]
        s.signature = _signature(offers, others, s.chains if s.drafts else None)
        taus = s.taus if s.drafts else [1.0] * len(offers)
        batch = []
        for o, size, tau in zip(offers, s.sizes, taus, strict=True):
            k = list(o.sizes).index(size)
            row = ((size, tau, self.nodes(o, size), o.levels[k], costs(o)[k]),)
            batch.append(_Group(o.method, row, 1, self._catch_up(o, row) if size > 1 else 0.0))
        s.seconds = self._evaluate(batch, s.sizes, others).seconds

    def _quiet_step(self, offers: list[Offer], others: int) -> dict[str, int] | None:
        """`choose` for a step its all-auto-regressive decision stands for quietly
        (`_quiet`), with what it does there and no more (None where the step takes the full
        path): every request at size 1, the step's exploration credit, its counts. Through
        the full path (`_standing`) a standing step's choice took 26-28 us with the caches a
        forward leaves, 19-23 this way (recorded calls replayed, ReDrafter and Lyanna at
        batch 1, T=1; ~6 us in the engine, where AR's choice takes ~1.5)."""
        s = self._settled
        if (
            s is None
            or not SHORT_PATHS
            or s.quiet[0] <= 0
            or others != s.quiet[1]
            or len(offers) != len(s.keys)
            or self._ended
            or self._runs
            or self._plain_left > 0
        ):
            return None
        # `_quiet`'s test and `give`'s dict in one loop: through them (a list of keys, a
        # generator) a standing step's choice took ~2.7 us more, cold (replayed as above)
        for o, key in zip(offers, s.keys, strict=True):
            if o.key != key or len(o.sizes) == 1 or (o.left is not None and o.left <= 1):
                return None  # (`choose` sets these apart before the decision)
        steps = self.steps + 1
        age = steps - s.step
        if age >= s.stands or (credit := self._stand_credit(s, age, steps >= s.quiet[0])) is None:
            return None
        self.steps, self._expected, self.credit = steps, s.seconds, credit
        self.reused += 1
        chosen = self.chosen
        for o in offers:
            chosen[(o.method, 1)] += 1
        s.given = dict.fromkeys(s.keys, 1)
        return dict(s.given)

    def _stand_credit(self, s: _Settled, age: int, can_probe: bool) -> float | None:
        """The exploration credit after a step `s` stands for, `age` steps after it was made,
        or None where a probe comes due at it (`can_probe`: some kind of its requests was
        last measured `PROBE_EVERY` steps ago or more)."""
        loss = s.probe_loss + s.probe_growth * age if can_probe and s.probe_loss is not None else None
        credit = self._earned(s.seconds, loss, s.drafts)
        return None if loss is not None and credit >= loss else credit

    def _quiet(self, s: _Settled, offers: list[Offer], others: int) -> bool:
        """Whether `s`, an all-auto-regressive decision, stands for `offers` with only the
        probe's check of `_standing`: they are the requests it last stood for (so their
        kinds and options: the signature), with the same other requests (`_Settled.quiet`);
        no tree is verified while it stands, so no kind's last measurement moves and the
        step from which a probe can come is known. The other checks cost ~3 us a step more
        in the engine (ReDrafter at batch 1, T=1); while a decision was quiet only until a
        probe could come (`PROBE_EVERY` after its kind's last measurement), 1549 of its 2005
        steps there ran them."""
        return s.quiet[0] > 0 and others == s.quiet[1] and s.keys == [o.key for o in offers]

    def _earned(self, seconds: float, probe_loss: float | None, drafting: bool) -> float:
        """The exploration credit after a step of `seconds`: it earns `PROBE_SHARE` of them
        (halved `futile` times while the decision is `drafting`: `PROBE_BACKOFF`; else
        `futile_plain` times: `PLAIN_BACKOFF`), capped at
        one step, or at the loss of the probe it saves for (None: no probe can run)."""
        cap = seconds if probe_loss is None else max(seconds, probe_loss)
        share = PROBE_SHARE * 0.5 ** (self.futile if drafting else self.futile_plain)
        return min(self.credit + share * seconds, cap)

    @staticmethod
    def _learns_plain(since_heavy: int, requests: int) -> bool:
        """Whether a plain step of `requests` requests, the `since_heavy`-th plain step after
        the last that prefilled or drafted trees, teaches the auto-regressive tables (`AFTER_PREFILL`)."""
        return since_heavy > AFTER_PREFILL or requests == 1

    def _evaluate(self, batch: list[_Group], sizes: list[int], others: int) -> _Choice:
        tokens, nodes, requests = 0.0, float(others), others
        # drafting-cost fit -> [most levels, drafted nodes, tokens caught up a step, request-levels]
        drafting: dict[str, list[float]] = {}
        for g, s in zip(batch, sizes, strict=True):
            if not g.count:
                continue
            _, tau, n, levels, fit = g.entry(s)
            tokens += g.count * tau
            nodes += g.count * n
            requests += g.count
            if s > 1:
                acc = drafting.get(fit)
                if acc is None:
                    acc = drafting[fit] = [0.0, 0.0, 0.0, 0.0]
                acc[0] = max(acc[0], levels)
                acc[1] += g.count * (s - 1)
                acc[2] += g.catch_up
                acc[3] += g.count * levels
        key = (requests, nodes, bool(drafting))
        prices = self._prices
        seconds = prices.get(key) if prices is not None else None
        if seconds is None:
            seconds = self.overhead_of(requests, key[2]) + self.forward_cost(nodes, requests)
            if prices is not None:
                prices[key] = seconds
        for fit, (most, drafted, caught_up, request_levels) in drafting.items():
            cost = self.draft_cost.get(fit)
            seconds += cost(most, drafted, caught_up, request_levels) if cost is not None else 0.0
        return _Choice(sizes, tokens, seconds)

    def overhead_of(self, requests: int, trees: bool) -> float:
        """Host seconds of a step of `requests` decoding requests, with trees or roots only."""
        roots = by_requests(self.overhead, requests, per_request=False)
        if not trees or not self.overhead_trees:
            return roots
        return max(by_requests(self.overhead_trees, requests, per_request=False), roots)

    def _draft_slopes(self, fit: str, requests: int) -> tuple[float, float, float]:
        """(seconds per level of one request: its share of the call's level plus its own
        request-level; seconds per drafted node; seconds per token caught up) of the
        drafting-cost fit `fit` (`draft_cost`)."""
        cost = self.draft_cost.get(fit)
        if cost is None or not cost:
            return 0.0, 0.0, 0.0
        per_level, per_node, per_token, per_request_level = cost.slopes()
        return float(per_level) / requests + float(per_request_level), float(per_node), float(per_token)

    def _end_run(self, key: str) -> None:
        """Request `key` stopped drafting (or left): its run's length joins its method's
        mean at the next choice (`_horizon`)."""
        run = self._runs.pop(key, None)
        if run is not None:
            self._ended.append(run)

    def _horizon(self, method: str) -> float:
        """Steps a run of drafting of `method` is expected to last (`CATCH_UP_HORIZON`; `_fold_runs`)."""
        return max(self.horizons.get(method, CATCH_UP_HORIZON), 1.0)

    def _catch_up(self, offer: Offer, row: Row) -> float:
        """Tokens `offer`'s drafter catches up on per step of a steady choice to draft: its
        lag over the steps its method's runs of drafting last (`_horizon`), and never over
        more steps than it has left (`Offer.left` at the most tokens a step of its `row`
        yields: `CATCH_UP_WITHIN_LEFT`)."""
        if not offer.lag:
            return 0.0
        steps = self._horizon(offer.method)
        if offer.left is not None and CATCH_UP_WITHIN_LEFT:
            steps = min(steps, max(offer.left / max(e[1] for e in row), 1.0))
        return offer.lag / steps

    def _fold_runs(self) -> None:
        """The runs of drafting that ended since the last step join their methods' mean run
        lengths (`horizons`) as one observation, their mean: the requests of a batch mostly
        stop together, by one decision, and taken one by one, 8 requests that drafted one
        step (their first trees unlucky, auto-regression not yet measured at batch 8 and
        priced low) cut sd's horizon from 13 to 4.5 steps. Their prompts' catch-up, then
        charged nearly whole, kept them auto-regressive for ~30 steps where 3- to 5-node
        chains ran ~10% faster (T=1)."""
        ended: dict[str, list[int]] = {}
        for m, steps in self._ended:
            ended.setdefault(m, []).append(steps)
        self._ended.clear()
        for m, lengths in ended.items():
            mean = self.horizons.get(m, CATCH_UP_HORIZON)
            self.horizons[m] = mean + HORIZON_EMA * (sum(lengths) / len(lengths) - mean)

    # ---- measurements -------------------------------------------------------------------

    def calibrate(self, forward: Callable[[int], None], most: int, steps: Collection[int] = ()) -> None:
        """Seed the forward-cost table: `forward(n)` runs a target forward of n tokens, at
        `CALIBRATION_SIZES` and on both sides of each of the runner's cost `steps`
        (`ModelRunner.cost_steps`: n where n + 1 tokens cost a step more), so that the
        table's lines between timed sizes follow the staircase instead of cutting across it:
        timed at 5 and 8 tokens alone, a 6-token forward of the CPU target (one pass of its
        few-row products, like 5) was priced on the line to 8 (two passes), ~0.1 ms above its
        cost, and load-aware sd with chains of 5 drafts (`beam_length=5`) at batch 1 took
        6-node chains in 655 of 801 request-steps, 1.62x auto-regression at T=0 (1.35x at
        T=1); timed on both sides of the steps, 714 of 793 and 1.67x (1.44x); ReDrafter at
        batch 1 and 8 the same within noise (2-core Sapphire Rapids, 6 and 8 alternating
        rounds). Sizes go in ascending order, each once untimed (a shape's first forward
        pays one-off set-up: kernel selection, allocator growth) and then `CALIBRATION_ROUNDS` times in a
        row, keeping the fastest: a few-token forward timed right after a large one is not
        what a decoding step costs (a CPU runs the forwards that follow a stretch of heavy
        GEMMs up to ~2x slower: one-token forwards after 40 GEMMs of 512 x 384 x 4096 took
        2.6, 2.2, 1.5, then 1.2 ms; after reading 200 MB, no slower), and visiting the sizes in turn priced
        the demo target's 1-8-token forwards at 1.6-1.7 ms where a run of them takes ~1.2
        (2-core Sapphire Rapids). A forward of more tokens never costs less: the times are
        made non-decreasing by pooling (`monotone`) rather than by carrying the largest so
        far upward, which let one slow 1-token timing price every tree up to 17 tokens like
        a 1-token forward (verification looked free and drafting paid where it did not).
        Live steps only correct the per-request residual, so the table's shape stays what
        calibration measured. Whatever live steps taught before (an engine that served
        auto-regressive requests first: a table of their timings, `ForwardCost.observe`, and
        residuals against it) goes: the residuals were measured against that table. Kept,
        a batch-1 warm-up's one timing, scaled per token, priced 32 tokens at ~72 ms, the
        residual of 32 requests came out at -65 ms, every step had a negative price, and
        load-aware sd at batch 32 drafted 5-node chains at 0.8x auto-regression."""
        self._learn_plain()  # (the host work's table stays)
        self.forward_cost = ForwardCost()
        sizes = sorted({min(n, most) for n in (*CALIBRATION_SIZES, *steps, *(s + 1 for s in steps))})
        best = {}
        for n in sizes:
            forward(n)
            timings = []
            for _ in range(CALIBRATION_ROUNDS):
                start = time.perf_counter()
                forward(n)
                timings.append(time.perf_counter() - start)
            best[n] = min(timings)
        for n, seconds in zip(sizes, monotone([best[n] for n in sizes]), strict=True):
            self.forward_cost.calibrate(n, seconds)

    def add_draft_samples(self, fit: str, samples: Iterable[DraftCall]) -> None:
        """Drafting calls timed at engine start, for the drafting-cost fit `fit` (`Offer.costs`)."""
        for levels, drafted, caught_up, request_levels, seconds in samples:
            self._add_draft_sample(fit, (levels, drafted, caught_up, request_levels), seconds, start_up=True)

    def _add_draft_sample(self, key: str, x: tuple[int, int, int, int], seconds: float, start_up: bool = False) -> None:
        levels, drafted, caught_up, request_levels = x
        # catch-ups come in every length: one shape per power of two keeps the fit's memory
        # bounded. One no longer than the drafted nodes (the last token or two of requests
        # that did not draft last step) is the shape of none, so that live steps of a steady
        # choice replace its start-up stand-ins: shaped apart ((3, 24, 4) live vs (3, 24, 0)
        # start-up), rsd-s at batch 8, T=1 kept start-up samples ~35% cheaper than live ones
        # in its fit and priced its drafting ~1-1.5 ms low, drafting at ~0.9x auto-regression
        shape = (levels, drafted, 1 << caught_up.bit_length() if caught_up > drafted else 0, request_levels)
        fit = self.draft_cost.get(key)
        if fit is None:
            fit = self.draft_cost[key] = LinearCost()
            if not start_up:
                # a drafter's first call in the process is cold (lazy kernel loading, JIT,
                # allocator growth): with nothing timed at start-up to set against it, it is
                # not learned from. Lyanna's first call on an H200, before it was timed at
                # start-up, took 92-154 ms (a whole step of fixed trees: ~4 ms) and was its
                # fit's only sample: every tree was priced at 150-300 ms and nothing was
                # drafted again, not even a probe (whose expected loss the 2% credit never
                # covered)
                return
        if not start_up and (bound := fit.bound(shape, x)) is not None:
            # one call over its shape's price counts as `SPIKE` times that much
            # (`LinearCost.bound`), as a forward does (`ForwardCost.observe`): one rsd-c
            # drafting call at T=1, batch 1 delayed by 80 ms (a pause of the process) priced its
            # chains so high that the request stayed auto-regressive for the rest of the run
            # (98% of ~1600 steps), its probes drafting the wider trees of the other cost
            # path, whose calls never time chains again
            seconds = min(seconds, bound)
        fit.add(x, seconds, shape, start_up)

    def observe(self, stats: StepStats) -> None:
        if self._observe_plain(stats):
            return
        self._learn_plain()  # (in their order: the tables below are learned at once)
        if not self.adaptive:  # fixed sizes price nothing: learn only what reports read
            self.idle += not stats.outcomes
            self.since_heavy = 0 if stats.prefill or stats.num_tokens > stats.num_requests else self.since_heavy + 1
            self._learn_trees(stats.outcomes, self.steps, self.idle, everything=False)
            return
        settled = self._settled
        if settled is not None:
            if any(o.size != settled.given.get(o.key) for o in stats.outcomes):
                # a tree of a size it did not give (a probe's): decide afresh
                self._settled, self._unsettled = None, "tree"
                settled.expecting = None
            else:
                settled.yielded(sum((1.0 + o.accepted for o in stats.outcomes), 0.0))
        trees = stats.num_tokens > stats.num_requests
        self.idle += not stats.outcomes
        self._settle_probe(stats, trees)
        self.since_heavy = 0 if stats.prefill or trees else self.since_heavy + 1
        probe, self._plain_probing = self._plain_probing and not trees, False
        if not stats.prefill and (trees or self._learns_plain(self.since_heavy, stats.num_requests)):
            if not trees:
                self._plain_timed[stats.num_requests] = self.steps
            timing = (stats.num_tokens, stats.num_requests, stats.forward_seconds, stats.overhead_seconds)
            if self._learn_timing(*timing, probe):
                # a first step of its shape at this count: the decision priced it by
                # extrapolation (a first auto-regressive step of 8 requests at 5.1 ms where it
                # took ~7; standing 16 steps on it, sd at T=1 stayed auto-regressive where
                # chains ran ~10% faster)
                self._settled, self._unsettled = None, "shape"
        for o in stats.outcomes:  # what a standing decision reads (`_standing`): learned at once
            if o.size == o.sizes[-1]:
                self._measured[o.key] = self._measured[o.kind] = self.steps
            if o.key not in self.requests:
                self.requests[o.key] = {}
        if stats.outcomes or stats.drafting:
            self._unlearned.append((stats.outcomes, stats.drafting, self.steps, self.idle))

    def _observe_plain(self, stats: StepStats) -> bool:
        """`observe` for a plain decoding step (an all-auto-regressive decision's, or of
        requests none of which had a size to choose) with nothing to settle (no trees a
        decision expects, no probe, none of its aftermath) whose request count was timed
        before (so it is no first of its shape): its timings wait in `_plain_unlearned` for
        `learn`, like trees (`PLAIN_UNLEARNED_MOST` at most). Learned at once, they cost ~7 us
        of a batch-1 step with the caches a forward leaves (ReDrafter, T=1), and an
        auto-regressive engine's whole `observe` ~17 us; what reads the tables learns first
        (`_solve`, `_rebase`, `calibrate`). False where the step takes the full path."""
        s = self._settled
        r = stats.num_requests
        if (
            not SHORT_PATHS
            or (s is not None and s.expecting is not None)
            or not self.adaptive
            or stats.outcomes
            or stats.drafting
            or stats.prefill
            or stats.num_tokens != r
            or self._bill is not None
            or self._aftermath
            or self._plain_probing
            or r not in self.forward_cost.extra
        ):
            return False
        self.idle += 1
        self.since_heavy += 1
        if self._learns_plain(self.since_heavy, r):
            self._plain_timed[r] = self.steps
            self._plain_unlearned.append((stats.num_tokens, r, stats.forward_seconds, stats.overhead_seconds))
            if len(self._plain_unlearned) >= PLAIN_UNLEARNED_MOST:
                self._learn_plain()
        return True

    def _learn_plain(self) -> None:
        """The plain steps' timings `_observe_plain` kept, into the forward's and host work's
        tables, in their order, as `observe` learns them."""
        if not self._plain_unlearned:
            return
        steps, self._plain_unlearned = self._plain_unlearned, []
        for timing in steps:
            self._learn_timing(*timing)

    def _learn_timing(self, n: int, requests: int, seconds: float, host: float | None, probe: bool = False) -> bool:
        """A step's forward (`n` tokens of `requests` requests) and host work (None: not
        measured) into their tables, trees' apart (the host work capped at `SPIKE` times its
        price once timed); whether it was the first of its shape at this count
        (`ForwardCost.observe`)."""
        first = self.forward_cost.observe(n, requests, seconds, probe)
        if host is not None:
            table = self.overhead_trees if n > requests else self.overhead
            if table.timed(requests):
                host = min(host, step_costs.SPIKE * table[requests])
            table.add(requests, host, probe)
        return first

    def learn(self) -> None:
        """Learn the trees and drafting calls of the steps observed since the last call
        (`observe`), in their order, as if each had been learned in its own step: what they
        teach (the estimates, each request's own, the drafting-cost fits) is read only where
        a decision is made afresh (`_solve`, `_rebase`, `_settle_probe`'s bill; `forget`,
        `taus` and `kind_taus` too; a reader of the tables themselves calls this first, in
        the engine's thread), not while one stands. Learned in every step, they cost ~75 us of a
        batch-1 step with the caches a forward leaves (ReDrafter, 2-thread EPYC, recorded
        steps replayed: the policy's choice and learning 200 -> 165 us a step at batch 1,
        365 -> 330 at batch 8); several steps learned together meet warm caches after the first."""
        self._learn_plain()
        if not self._unlearned:
            return
        steps, self._unlearned = self._unlearned, []
        for outcomes, drafting, step, idle in steps:
            for method, (levels, drafted, caught_up, request_levels, seconds) in drafting.items():
                if drafted:
                    self._add_draft_sample(method, (levels, drafted, caught_up, request_levels), seconds)
            self._learn_trees(outcomes, step, idle)

    def _learn_trees(self, outcomes: list[Outcome], step: int, idle: int, everything: bool = True) -> None:
        """Step `step`'s verified trees (the `idle` clock then) into the kinds' estimates
        (`estimates`, what reports read) and, for a policy that chooses (`everything`), the
        gains between sizes and each request's own estimates. Every step of a fixed policy
        (auto-regression included) did it all, and the cost tables' learning too, for
        nothing: ~25 us of a step, AR at batch 1 ran ~1% faster without."""
        means: TreeSums = {}
        gains: TreeSums = {}
        overs: TreeSums = {}
        for o in outcomes:
            budget, accepted = o.node_budget, o.accepted
            # a chain's budgets, its first nodes accepted (most trees): at each smaller size c,
            # min(accepted, c - 1) of c nodes kept, as below, without sorting and bisecting
            # (ascending: sizes ascend; same states after replaying recorded steps)
            chain = o.nodes == o.size and budget == _chain_lists(o.nodes)[1]
            if chain and o.path == _chain_lists(accepted + 1)[0]:
                measured = [(c, min(accepted, c - 1), c) for c in o.sizes if 1 < c < o.size]
                measured.append((o.size, accepted, o.nodes))
            else:
                measured = [(o.size, accepted, o.nodes)]
                if budget:
                    # at each smaller size c: the kept nodes and the nodes whose budget is within c
                    kept = sorted([budget[n] for n in o.path[1:]])
                    budgets = sorted(budget)
                    measured += [
                        (c, bisect.bisect_right(kept, c), bisect.bisect_right(budgets, c))
                        for c in o.sizes
                        if 1 < c < o.size
                    ]
                measured.sort()  # every offered size up to the tree's: each pair is a size and the next smaller
            if not everything:
                for size, accepted, nodes in measured:
                    _add_tree(means, (o.kind, size), 1.0 + accepted, nodes)
                continue
            for (_, kept_below, _), (size, accepted, _) in itertools.pairwise(measured):
                _add_tree(gains, (o.kind, size), float(accepted - kept_below), 0.0)
            if o.cuts is not None and o.size > o.cuts and (largest := self.kinds.get((o.kind, o.cuts))) is not None:
                for size, accepted, _ in measured:  # over the largest cut's estimate now (`OVER_CHAIN`)
                    if size > o.cuts:
                        _add_tree(overs, (o.kind, size), 1.0 + accepted - largest.tau, 0.0)
            mine = self.requests.setdefault(o.key, {})
            for size, accepted, nodes in measured:
                tau = 1.0 + accepted
                _add_tree(means, (o.kind, size), tau, nodes)
                own, n, _ = mine.get(size, (tau, 0, 0))
                # a running mean over its first trees, decayed after (one lucky tree must not
                # stand for five: started at the first tree, the decayed mean did)
                weight = max(1.0 / (n + 1), REQUEST_EMA)
                mine[size] = (own + weight * (tau - own), n + 1, step)
        # one update per step, its trees' mean: weighed by its trees while they are few (`GROUP_EMA`)
        tables = [(self.kinds, means, False), (self.gains, gains, False), (self.over, overs, False)]
        if everything:
            tables += [(self.long_run, means, True), (self.long_gains, gains, True)]
        for estimates, observed, long_run in tables:
            for key, (tokens_sum, nodes_sum, count) in observed.items():
                trees = int(count)
                mean_tau, mean_nodes = tokens_sum / trees, nodes_sum / trees
                e = estimates.get(key)
                if e is None:
                    estimates[key] = e = Estimate(mean_tau, mean_nodes)
                if long_run:  # never aged (`LONG_RUN_TREES`)
                    e.recent, e.trees, e.last = e.recent + trees, e.trees + trees, step
                    w = max(trees / e.recent, min(trees / LONG_RUN_TREES, GROUP_EMA))
                else:
                    e.recent, e.trees, e.last, e.idle = e.weight(idle) + trees, e.trees + trees, step, idle
                    w = max(trees / e.recent, GROUP_EMA)  # a mean over its trees, then per step
                e.tau += w * (mean_tau - e.tau)
                e.nodes += w * (mean_nodes - e.nodes)

    def _settle_probe(self, stats: StepStats, trees: bool) -> None:
        """Charge a probe what it cost (`PROBE_SHARE` is of throughput, not of predictions):
        its step's loss against the rate it was weighed against, less the expected loss
        charged when it was chosen (down to no loss: a probe that paid does not earn
        credit), and the plain steps after it, up to `AFTER_PREFILL` of them, what they took
        beyond their predicted time (a CPU runs them slow after a tree step; the next step
        that prefills or drafts trees ends that). Charged its prediction alone, exploration
        spent ~2x its share: ReDrafter at batch 8, T=0, a probe of one request's 21-node
        tree cost 2.6-3.2 ms in its step, and the 4 plain steps after it 2 ms more than
        their ~2.5 ms each (2-core Sapphire Rapids). The policy's own choice counts in these
        steps too (`StepStats.choose_seconds`): a probe ends a standing decision, so its step
        and the next solve in full (~0.3 ms each at batch 8), and uncharged, cheap probes (a
        6-node chain's, `PROBE_CHAINS_WHILE_PLAIN`) came ~3x as often as the 21-node trees
        before them (ReDrafter at T=1, batch 8, 10 alternating rounds: 0.957 -> 0.978x AR
        charged; batch 1, 26 rounds: ~0.97 -> ~0.98)."""
        bill, self._bill = self._bill, None
        if bill is not None:
            self.learn()  # (the drafting-cost fits it reads)
        seconds = stats.priced_seconds
        if seconds is None or stats.prefill:
            self._aftermath = 0
            return
        seconds += stats.choose_seconds  # the full solves a probe causes: its step's and the next's
        if bill is not None:
            charged, rate, decoding, drafting = bill
            tokens = decoding + sum(o.accepted for o in stats.outcomes)
            loss = seconds - tokens / max(rate, 1e-12)
            self.credit -= max(loss, 0.0) - charged
            # whether drafting paid in it: less its drafter's catch-up (a one-off any run of drafting pays)
            caught_up = sum((self._draft_slopes(fit, 1)[2] * call[2] for fit, call in stats.drafting.items()), 0.0)
            paid = loss - caught_up <= 0
            if drafting:
                self.futile = 0 if paid else min(self.futile + 1, PROBE_BACKOFF)
            else:
                self.futile_plain = 0 if paid else min(self.futile_plain + 1, PLAIN_BACKOFF)
            self._aftermath = AFTER_PREFILL
        elif self._aftermath:
            if trees or self._expected is None:
                self._aftermath = 0
            else:
                self.credit -= seconds - self._expected
                self._aftermath -= 1

    def forget(self, key: str) -> None:
        """A request left: drop its own estimates (its run of drafting ends). A settled
        decision that counted it stands for a request with no trees of its own in its place
        (`_standing`), another under its id included."""
        self.learn()  # (its last trees first)
        self._end_run(key)
        self._measured.pop(key, None)
        self._born.pop(key, None)
        self.requests.pop(key, None)


_CHAINS: list[tuple[list[int], list[int]]] = []


def _chain_lists(nodes: int) -> tuple[list[int], list[int]]:
    """([0, ..., nodes - 1], [1, ..., nodes]): the path through a chain's first `nodes`
    nodes, and the `DraftTree.node_budget` of a chain of `nodes` nodes (node i is in every
    tree of i + 1 nodes or more), for `_learn_trees` to compare with."""
    while len(_CHAINS) <= nodes:
        n = len(_CHAINS)
        _CHAINS.append((list(range(n)), list(range(1, n + 1))))
    return _CHAINS[nodes]


def _add_tree(sums: TreeSums, key: tuple[Hashable, int], tokens: float, nodes: float) -> None:
    """One tree's tokens and nodes into a step's sums per (kind, size) (`_learn_trees`)."""
    acc = sums.get(key)
    if acc is None:
        sums[key] = [tokens, nodes, 1]
    else:
        acc[0] += tokens
        acc[1] += nodes
        acc[2] += 1


def _pick(group: _Group, rate: float, fslope: float, slopes: dict[str, tuple[float, float, float]]) -> int:
    """The size maximising tau - rate * marginal cost for a request of `group` (one
    Dinkelbach step for one request); `slopes`: per drafting-cost fit, (seconds per level
    of a request, per drafted node, per token caught up)."""
    best, value = 1, -np.inf
    lag = group.catch_up / max(group.count, 1)
    for size, tau, nodes, levels, fit in group.row:
        per_level, per_node, per_token = slopes[fit]
        catch_up = per_token * lag if size > 1 else 0.0
        extra = fslope * (nodes - 1) + per_node * (size - 1) + per_level * levels + catch_up
        v = tau - rate * extra
        if v > value:
            best, value = size, v
    return best


def draft_fit(method: str, path: str) -> str:
    """The drafting-cost fit of `method`'s drafting `path` (`Proposer.cost_paths`; "": its only one)."""
    return f"{method}/{path}" if path else method


def costs(offer: Offer) -> Sequence[str]:
    """The drafting-cost fit of each of `offer`'s sizes (`Offer.costs`; its method's)."""
    return offer.costs or [offer.method] * len(offer.sizes)


def _kind_name(kind: Hashable) -> str:
    if isinstance(kind, tuple):
        return "/".join(str(k) for k in kind)
    return str(kind)


def _optimistic(estimate: Estimate | None, most: float) -> float:
    """`estimate`'s mean with `KIND_PRIOR` trees' worth of `most` (`most` alone without one;
    the mean alone where `most` is no more than it: no optimism to add)."""
    if estimate is None:
        return most
    if most <= estimate.tau:
        return estimate.tau
    return (estimate.trees * estimate.tau + KIND_PRIOR * most) / (estimate.trees + KIND_PRIOR)


def _pessimistic(estimate: Estimate | None, least: float) -> float:
    """`estimate`'s mean with `KIND_PRIOR` trees' worth of `least` (`least` alone without one;
    the mean alone where `least` is no less than it). One 11-node ReDrafter tree that kept
    every draft read 6 tokens a step, where 6-node chains made 3.3; taken at its mean by
    every request of a batch of 32, they drafted 11-node trees (a 47 ms step where
    auto-regression takes ~8)."""
    if estimate is None:
        return least
    if least >= estimate.tau:
        return estimate.tau
    return (estimate.trees * estimate.tau + KIND_PRIOR * least) / (estimate.trees + KIND_PRIOR)


def ceiling(offer: Offer, size: int) -> float:
    """The most tokens a step of `offer` at `size` can yield: a draft per sequential drafter
    call (level) and the bonus token, and never more than the tree's nodes (a chain drafted
    by lookup, with no levels, is its size)."""
    levels = offer.levels[offer.sizes.index(size)]
    return float(min(size, levels + 1) if levels else size)


def within_room(offer: Offer, room: int) -> Offer:
    """`offer` less the sizes whose trees take more than `room` nodes beyond the root
    (`Scheduler.tree_room`: the budget a step's prompts leave the trees), the root alone
    where none fits; `offer` itself where every size fits."""
    k = bisect.bisect_right(offer.sizes, 1 + max(room, 0))
    if k == len(offer.sizes):
        return offer
    return replace(offer, sizes=offer.sizes[:k], levels=offer.levels[:k], costs=offer.costs[:k])


def largest_fitting(sizes: Sequence[int], budget: int) -> int:
    """The largest of `sizes` (ascending) within `budget`, or 1 (the root alone)."""
    i = bisect.bisect_right(sizes, budget)
    return sizes[i - 1] if i else 1
