//! Drawing a sequence's next token from its logits: greedy, or temperature sampling from a seeded
//! generator among the tokens the top-k, min-p and nucleus (top-p) filters keep, after the request's
//! [`Penalties`]. A sequence's draws depend only on its logits, its own prompt and output, and its seed,
//! never on the batch, so a sampled request gives the same tokens alone, in a batch of a server, and
//! through `generate`.
//!
//! One draw of a 262144-token vocabulary used to cost a full sort of it (about 10 ms, as much as the
//! forward pass of a decode step). Now the weights go into a buffer the sequence keeps, the whole
//! vocabulary is drawn from in token order when no filter is on, and otherwise only the tokens that can
//! pass the filters are sorted (the `top_k` heaviest are selected first, without a sort).

use std::collections::{HashMap, HashSet};

use super::Sampling;

/// Changes to a sequence's logits before its next token is chosen (greedy or sampled), as OpenAI's and
/// vLLM's completions APIs define them. They apply in this order: the bias, the repetition penalty, then
/// the presence and frequency penalties. The logits a response's hash covers are the model's, before
/// any of them.
#[derive(Clone, Debug, PartialEq)]
pub struct Penalties {
    /// Subtracted from the logit of every token the output already holds (OpenAI's `presence_penalty`).
    pub presence: f32,
    /// Subtracted once for each time the output holds the token (`frequency_penalty`).
    pub frequency: f32,
    /// A token in the prompt or the output has its logit divided by this when positive and multiplied by
    /// it when not (vLLM's and transformers' `repetition_penalty`; 1 leaves logits alone).
    pub repetition: f32,
    /// Added to a token's logit (`logit_bias`): token id and bias.
    pub bias: Vec<(u32, f32)>,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties { presence: 0.0, frequency: 0.0, repetition: 1.0, bias: Vec::new() }
    }
}

impl Penalties {
    /// Whether these change any logit.
    pub fn any(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0 || !self.bias.is_empty()
    }
}

/// Tokens a sequence may not draw yet: those that would end it, before its `min_tokens`.
#[derive(Clone, Debug, Default)]
pub(super) struct Held {
    /// The tokens.
    pub(super) tokens: Vec<u32>,
    /// Draws before which they are held back.
    pub(super) until: usize,
}

/// A sequence's sampling state: its settings, its generator and its scratch space.
#[derive(Debug)]
pub(super) struct Sampler {
    sampling: Sampling,
    penalties: Penalties,
    held: Held,
    /// Tokens drawn so far.
    drawn: usize,
    /// How often each token has been chosen so far (for the presence and frequency penalties).
    counts: HashMap<u32, u32>,
    /// The prompt's tokens, where the repetition penalty needs them.
    prompt: HashSet<u32>,
    /// The logits with the penalties applied, reused from draw to draw.
    adjusted: Vec<f32>,
    rng: Rng,
    /// Each token's weight `exp((logit - max) / temperature)`, reused from draw to draw.
    weights: Vec<f32>,
    /// The nucleus's candidates, `(weight, token)`, reused likewise.
    candidates: Vec<(f32, u32)>,
}

impl Sampler {
    pub(super) fn new(sampling: Sampling, penalties: Penalties, held: Held, prompt: &[u32]) -> Self {
        let seed = match sampling {
            Sampling::Sample { seed, .. } => seed ^ 0x9E37_79B9_7F4A_7C15,
            Sampling::Greedy => 0,
        };
        let prompt = if penalties.repetition != 1.0 { prompt.iter().copied().collect() } else { HashSet::new() };
        Self {
            sampling,
            penalties,
            held,
            drawn: 0,
            counts: HashMap::new(),
            prompt,
            adjusted: Vec::new(),
            rng: Rng(seed),
            weights: Vec::new(),
            candidates: Vec::new(),
        }
    }

    /// The next token from the model's `logits` (not empty), after the [`Penalties`], which then count
    /// it as part of the output, and with the [`Held`] tokens' logits -inf (and their weights 0) while
    /// they are held.
    pub(super) fn next(&mut self, logits: &[f32]) -> u32 {
        let holding = self.drawn < self.held.until;
        self.drawn += 1;
        let held = std::mem::take(&mut self.held.tokens);
        let token = self.next_holding(logits, if holding { &held } else { &[] });
        self.held.tokens = held;
        token
    }

    fn next_holding(&mut self, logits: &[f32], held: &[u32]) -> u32 {
        if !self.penalties.any() && held.is_empty() {
            return self.sample(logits, held);
        }
        let mut adjusted = std::mem::take(&mut self.adjusted);
        adjusted.clear();
        adjusted.extend_from_slice(logits);
        let p = &self.penalties;
        for &(token, bias) in &p.bias {
            if let Some(l) = adjusted.get_mut(token as usize) {
                *l += bias;
            }
        }
        if p.repetition != 1.0 {
            for &token in self.prompt.iter().chain(self.counts.keys().filter(|t| !self.prompt.contains(t))) {
                if let Some(l) = adjusted.get_mut(token as usize) {
                    *l = if *l > 0.0 { *l / p.repetition } else { *l * p.repetition };
                }
            }
        }
        for (&token, &count) in &self.counts {
            if let Some(l) = adjusted.get_mut(token as usize) {
                *l -= p.presence + p.frequency * count as f32;
            }
        }
        for &token in held {
            if let Some(l) = adjusted.get_mut(token as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        let token = self.sample(&adjusted, held);
        self.adjusted = adjusted;
        *self.counts.entry(token).or_insert(0) += 1;
        token
    }

    /// The next token from `logits` (not empty).
    ///
    /// Greedy: the first largest logit. Sampling: token `i` weighs its probability `w_i`, the softmax of
    /// `logits / temperature` by the kernels' [`model::kernels::softmax`] (vectorized, and the same bits
    /// on every CPU, where a libm `expf` per token cost about a millisecond a draw of Gemma 3's 262144
    /// and gave the C library's bits). With no filter on, every token is kept, and a uniform draw `u` is
    /// walked through the weights in token order. Otherwise the tokens are ordered by weight, heaviest
    /// first (ties: the lower id), and each filter keeps a first part of that order: `top_k` the first
    /// `top_k`; `min_p` those of weight at least `min_p` times the heaviest's; then `top_p` those up to
    /// the first whose running share of what the other two kept (of 1 where they are off) reaches
    /// `top_p`. The draw is walked through what is left in that order.
    fn sample(&mut self, logits: &[f32], held: &[u32]) -> u32 {
        let (temperature, top_k, min_p, top_p) = match self.sampling {
            Sampling::Greedy => return model::forward::argmax(logits),
            Sampling::Sample { temperature, top_k, min_p, top_p, .. } => (temperature, top_k, min_p, top_p),
        };
        self.weights.clear();
        self.weights.extend_from_slice(logits);
        model::kernels::softmax(&mut self.weights, 1.0 / temperature);
        // A held token's logit is -inf, whose weight the clamped exponential makes about 1e-38 of the
        // sum: 0, so that no draw can land on it.
        for &token in held {
            if let Some(w) = self.weights.get_mut(token as usize) {
                *w = 0.0;
            }
        }
        // The probabilities' sum, to their rounding.
        let total = 1.0;
        let u = self.rng.next_f32();
        // A NaN among the logits, or an infinity, makes the softmax's sum and so every weight NaN.
        if self.weights.first().is_some_and(|w| w.is_nan()) {
            // Logits a broken model made (NaN): nothing to weigh them by, so the first largest; a
            // draw is still taken, so the generator stays in step.
            return model::forward::argmax(logits);
        }
        let top_k = (top_k as usize).min(self.weights.len());
        if top_k != 0 || min_p > 0.0 {
            return self.filtered(top_k, min_p, top_p, u);
        }
        if top_p >= 1.0 {
            let mut r = u * total;
            for (i, &w) in self.weights.iter().enumerate() {
                if r < w {
                    return i as u32;
                }
                r -= w;
            }
            // Rounding left the draw past the end: the last token that has any weight.
            return self.weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32;
        }
        // Tokens lighter than `floor` weigh less than `(1 - top_p) * total` all together, so the heavier
        // ones hold the nucleus: they are the heaviest tokens, the first of the full order. Rounding in
        // the running share can still miss `top_p` among them; then every token is a candidate, and
        // should the shares of all of them miss it too, all of them are kept.
        let floor = (1.0 - top_p) * total / self.weights.len() as f32;
        let last = self.nucleus(floor, top_p, total).or_else(|| self.nucleus(f32::NEG_INFINITY, top_p, total));
        let kept = match last {
            Some(last) => &self.candidates[..=last],
            None => &self.candidates[..],
        };
        draw(kept, u)
    }

    /// [`Sampler::sample`] with `top_k` (at most the vocabulary; 0: off) or `min_p` on: the candidates
    /// are the tokens of weight at least `min_p` times the heaviest's, cut to the `top_k` heaviest, in
    /// order; their total is summed in that order, and the nucleus taken of it.
    ///
    /// A small `top_k` (up to [`HEAP_TOP_K`]) is kept in a heap whose lightest is compared with each
    /// token, so most of a vocabulary costs one comparison (collecting every token to select from cost
    /// about 1 ms a draw of Gemma 3's 262144); a larger one is selected from all of them (the heap
    /// would replace its lightest for much of the vocabulary).
    fn filtered(&mut self, top_k: usize, min_p: f32, top_p: f32, u: f32) -> u32 {
        self.candidates.clear();
        let floor = match min_p > 0.0 {
            true => min_p * self.weights.iter().copied().fold(0.0, f32::max),
            false => 0.0,
        };
        let passing = self.weights.iter().enumerate().filter(|&(_, &w)| w >= floor).map(|(i, &w)| (w, i as u32));
        if top_k == 0 || top_k > HEAP_TOP_K {
            self.candidates.extend(passing);
            if top_k != 0 && self.candidates.len() > top_k {
                self.candidates.select_nth_unstable_by(top_k - 1, heaviest_first);
                self.candidates.truncate(top_k);
            }
        } else {
            let mut kept = std::collections::BinaryHeap::with_capacity(top_k + 1);
            // Once the heap is full, the weight of its lightest: a lighter token cannot come in (weights
            // are not NaN here), and is passed over by one comparison.
            let mut lightest = f32::NEG_INFINITY;
            for (w, i) in passing {
                if w < lightest {
                    continue;
                }
                if kept.len() < top_k {
                    kept.push(std::cmp::Reverse(Heavier(w, i)));
                } else if kept.peek().is_some_and(|l| Heavier(w, i) > l.0) {
                    kept.pop();
                    kept.push(std::cmp::Reverse(Heavier(w, i)));
                } else {
                    continue;
                }
                if kept.len() == top_k {
                    lightest = kept.peek().map_or(lightest, |l| l.0 .0);
                }
            }
            self.candidates.extend(kept.into_iter().map(|std::cmp::Reverse(Heavier(w, i))| (w, i)));
        }
        self.candidates.sort_unstable_by(heaviest_first);
        let total: f32 = self.candidates.iter().map(|c| c.0).sum();
        let last = (top_p < 1.0).then(|| reach(&self.candidates, top_p, total)).flatten();
        draw(&self.candidates[..last.map_or(self.candidates.len(), |l| l + 1)], u)
    }

    /// Sorts the tokens of weight `floor` or more into the candidates, heaviest first, and returns the
    /// index of the first whose running share reaches `top_p`, if one does.
    fn nucleus(&mut self, floor: f32, top_p: f32, total: f32) -> Option<usize> {
        self.candidates.clear();
        let heavy = self.weights.iter().enumerate().filter(|&(_, &w)| w >= floor);
        self.candidates.extend(heavy.map(|(i, &w)| (w, i as u32)));
        self.candidates.sort_unstable_by(heaviest_first);
        reach(&self.candidates, top_p, total)
    }
}

/// The order of every filter: the heavier first, and of two of one weight the lower id.
fn heaviest_first(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The index of the first of `candidates` (heaviest first) whose running share of `total` reaches
/// `top_p`, if one does.
fn reach(candidates: &[(f32, u32)], top_p: f32, total: f32) -> Option<usize> {
    let mut share = 0.0;
    candidates.iter().position(|&(w, _)| {
        share += w / total;
        share >= top_p
    })
}

/// The largest `top_k` kept in a heap ([`Sampler::filtered`]).
const HEAP_TOP_K: usize = 256;

/// A token by its weight, ordered as the filters order tokens: the heavier is greater, and of two of one
/// weight the lower id.
#[derive(Clone, Copy, Debug)]
struct Heavier(f32, u32);

impl PartialEq for Heavier {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for Heavier {}

impl PartialOrd for Heavier {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Heavier {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // The heavier is greater where it comes first.
        heaviest_first(&(other.0, other.1), &(self.0, self.1))
    }
}

/// `u` of the way through the weights of `kept` (heaviest first), as a token.
fn draw(kept: &[(f32, u32)], u: f32) -> u32 {
    let mass: f32 = kept.iter().map(|k| k.0).sum();
    let mut r = u * mass;
    for &(w, token) in kept {
        if r < w {
            return token;
        }
        r -= w;
    }
    // Rounding left the draw past the end: the last token that has any weight (all of them, with
    // `top_p` missed by every share, may end in tokens of none).
    kept.iter().rev().find(|k| k.0 > 0.0).or(kept.first()).expect("a nucleus holds a token").1
}

/// A small seeded generator (splitmix64) for sampling.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    /// A uniform float in `[0, 1)`.
    fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A draw that rounding carries past every weight (here `u` of 1) lands on the last token that has
    /// weight, never on a token of none.
    #[test]
    fn a_draw_past_the_end_lands_on_a_token_with_weight() {
        assert_eq!(draw(&[(0.75, 7), (0.25, 8), (0.0, 9)], 1.0), 8);
        assert_eq!(draw(&[(0.75, 7), (0.25, 8), (0.0, 9)], 0.5), 7);
    }

    /// Logits of `n` tokens from `seed`: a few heavy ones over a long flat tail, as a language model's.
    fn logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng(seed);
        (0..n).map(|i| if i % 97 == 3 { 8.0 + 4.0 * rng.next_f32() } else { 6.0 * rng.next_f32() - 3.0 }).collect()
    }

    /// Each token's probability at `temperature`, with its id.
    fn weighed(logits: &[f32], temperature: f32) -> Vec<(f32, u32)> {
        let mut p = logits.to_vec();
        model::kernels::softmax(&mut p, 1.0 / temperature);
        p.into_iter().zip(0..).collect()
    }

    /// The nucleus as a plain reading of its definition: every token sorted, then the running share.
    fn nucleus_by_full_sort(logits: &[f32], temperature: f32, top_p: f32) -> Vec<(f32, u32)> {
        let mut all = weighed(logits, temperature);
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        cut_at_share(all, top_p, 1.0)
    }

    /// The heaviest-first `all` up to the first whose running share of `total` reaches `top_p`.
    fn cut_at_share(mut all: Vec<(f32, u32)>, top_p: f32, total: f32) -> Vec<(f32, u32)> {
        let mut share = 0.0;
        let n = all.iter().position(|a| {
            share += a.0 / total;
            share >= top_p
        });
        all.truncate(n.map_or(all.len(), |n| n + 1));
        all
    }

    #[test]
    fn the_nucleus_is_the_full_sorts_and_each_draw_its_draw() {
        // The last three: nearly every token a candidate; and logits in steps of a half, full of ties.
        for (seed, temperature, top_p) in [
            (1, 1.0, 0.9),
            (2, 0.7, 0.5),
            (3, 1.5, 0.95),
            (4, 3.0, 0.999),
            (5, 0.2, 0.01),
            (6, 100.0, 0.9),
            (7, 2.0, 0.98),
            (8, 50.0, 0.5),
        ] {
            let mut logits = logits(5000, seed);
            if seed >= 7 {
                logits.iter_mut().for_each(|l| *l = (*l * 2.0).round() / 2.0);
            }
            let want = nucleus_by_full_sort(&logits, temperature, top_p);
            let sampling = Sampling::Sample { temperature, top_k: 0, min_p: 0.0, top_p, seed };
            let (mut sampler, mut rng) = (
                Sampler::new(sampling, Penalties::default(), Held::default(), &[]),
                Sampler::new(sampling, Penalties::default(), Held::default(), &[]).rng,
            );
            for _ in 0..50 {
                let got = sampler.sample(&logits, &[]);
                assert_eq!(got, draw(&want, rng.next_f32()), "seed {seed}, top_p {top_p}");
                assert!(want.iter().any(|w| w.1 == got), "a token outside the nucleus: {got}");
            }
        }
    }

    /// Sampling with the nucleus filter alone.
    fn nucleus_only(temperature: f32, top_p: f32, seed: u64) -> Sampling {
        Sampling::Sample { temperature, top_k: 0, min_p: 0.0, top_p, seed }
    }

    /// The three filters as a plain reading of their definitions: every token sorted, the first `top_k`
    /// kept, then those of weight `min_p` or more, then the running share of what is left.
    fn filtered_by_full_sort(
        logits: &[f32],
        temperature: f32,
        top_k: usize,
        min_p: f32,
        top_p: f32,
    ) -> Vec<(f32, u32)> {
        let mut all = weighed(logits, temperature);
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let heaviest = all[0].0;
        if top_k > 0 {
            all.truncate(top_k);
        }
        all.retain(|a| a.0 >= min_p * heaviest);
        let total: f32 = all.iter().map(|a| a.0).sum();
        cut_at_share(all, top_p, total)
    }

    #[test]
    fn top_k_and_min_p_keep_what_their_definitions_keep_and_each_draw_is_its_draw() {
        // Logits in steps of a half from seed 4 on: ties at the cut of top_k.
        for (seed, temperature, top_k, min_p, top_p) in [
            (1, 1.0, 40, 0.0, 1.0),
            (2, 0.7, 0, 0.05, 1.0),
            (3, 1.5, 64, 0.01, 0.95),
            (4, 1.0, 50, 0.0, 0.9),
            (5, 3.0, 7, 0.2, 0.5),
            (6, 100.0, 5000, 0.5, 1.0),
            (7, 1.0, 1, 0.0, 1.0),
            (8, 0.8, 20000, 1.0, 1.0),
        ] {
            let mut logits = logits(5000, seed);
            if seed >= 4 {
                logits.iter_mut().for_each(|l| *l = (*l * 2.0).round() / 2.0);
            }
            let want = filtered_by_full_sort(&logits, temperature, top_k.min(logits.len()), min_p, top_p);
            let sampling = Sampling::Sample { temperature, top_k: top_k as u32, min_p, top_p, seed };
            let (mut sampler, mut rng) = (
                Sampler::new(sampling, Penalties::default(), Held::default(), &[]),
                Sampler::new(sampling, Penalties::default(), Held::default(), &[]).rng,
            );
            for _ in 0..50 {
                let got = sampler.sample(&logits, &[]);
                assert_eq!(
                    got,
                    draw(&want, rng.next_f32()),
                    "seed {seed}: top_k {top_k}, min_p {min_p}, top_p {top_p}"
                );
            }
            // The greedy token alone, or with those tied with it.
            if top_k == 1 || min_p == 1.0 {
                assert!(top_k != 1 || want.len() == 1, "seed {seed}: one token left");
                assert!(want.iter().all(|w| w.0 == want[0].0), "seed {seed}: only the most likely");
                assert_eq!(want[0].1, model::forward::argmax(&logits), "seed {seed}: the greedy token first");
            }
        }
    }

    #[test]
    fn with_top_p_1_every_token_can_come_and_in_its_share() {
        // Four tokens of weights 1, 2, 3, 4 (logits their logs): 20000 draws land near 10%, 20%, 30%, 40%.
        let logits: Vec<f32> = [1f32, 2.0, 3.0, 4.0].iter().map(|w| w.ln()).collect();
        let mut sampler = Sampler::new(nucleus_only(1.0, 1.0, 9), Penalties::default(), Held::default(), &[]);
        let mut counts = [0u32; 4];
        for _ in 0..20_000 {
            counts[sampler.sample(&logits, &[]) as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let share = f64::from(c) / 20_000.0;
            let want = (i + 1) as f64 / 10.0;
            assert!((share - want).abs() < 0.02, "token {i}: {share:.3} of the draws, expected about {want}");
        }
    }

    /// Greedy choices of a sampler with `penalties` and prompt `prompt`, over the same logits each step.
    fn greedy(penalties: Penalties, prompt: &[u32], logits: &[f32], steps: usize) -> Vec<u32> {
        let mut s = Sampler::new(Sampling::Greedy, penalties, Held::default(), prompt);
        (0..steps).map(|_| s.next(logits)).collect()
    }

    #[test]
    fn each_penalty_moves_the_choice_as_its_api_defines_it() {
        let logits = [1.0, 0.9, 0.5, -0.2];
        let off = Penalties::default();
        assert_eq!(greedy(off.clone(), &[], &logits, 3), [0, 0, 0]);
        // Presence: once chosen, token 0 is 1.0 - 0.5 = 0.5 < 0.9, and token 1 then 0.4 < 0.5.
        let presence = Penalties { presence: 0.5, ..off.clone() };
        assert_eq!(greedy(presence, &[], &logits, 3), [0, 1, 0]);
        // Frequency: each choice costs 0.3 more, so tokens 0 and 1 take turns until both are below
        // token 2 (1.0 - 0.6 = 0.4 and 0.9 - 0.6 = 0.3 against 0.5).
        let frequency = Penalties { frequency: 0.3, ..off.clone() };
        assert_eq!(greedy(frequency, &[], &logits, 5), [0, 1, 0, 1, 2]);
        // Repetition over the prompt and the output: token 0 in the prompt is 1.0 / 2 = 0.5, so token 1
        // wins; then token 1 is 0.45, and token 0 ties token 2 at 0.5 and wins as the lower id. Token 3's
        // negative logit is multiplied.
        let repetition = Penalties { repetition: 2.0, ..off.clone() };
        assert_eq!(greedy(repetition.clone(), &[0], &logits, 2), [1, 0]);
        let mut s = Sampler::new(Sampling::Greedy, repetition, Held::default(), &[3]);
        s.next(&logits);
        assert_eq!(s.adjusted, [1.0, 0.9, 0.5, -0.4]);
        // A bias, before the penalties: +1 on token 2 makes it 1.5, and its presence penalty then 1.0,
        // which token 0 (1.0, earlier) ties and wins.
        let bias = Penalties { bias: vec![(2, 1.0)], presence: 0.5, ..off };
        assert_eq!(greedy(bias, &[], &logits, 2), [2, 0]);
    }

    #[test]
    fn logits_with_a_nan_still_give_a_token() {
        for logits in [[0.5, f32::NAN, 2.0, 1.0], [f32::NAN; 4]] {
            for top_p in [1.0, 0.5] {
                let mut sampler = Sampler::new(nucleus_only(1.0, top_p, 1), Penalties::default(), Held::default(), &[]);
                assert!(sampler.sample(&logits, &[]) < 4, "{logits:?}, top_p {top_p}");
            }
        }
    }

    /// Held tokens are never drawn while held, greedy or sampled, even as the likeliest; then they are.
    #[test]
    fn held_tokens_are_never_drawn_until_their_draw_count() {
        // Token 2 is by far the likeliest, token 0 next; ties and the first token are the cases where a
        // weight of about 1e-38 could still be drawn (a draw of 0 lands on the first token with weight).
        let logits = [1.0f32, -3.0, 30.0, -3.0];
        for sampling in [Sampling::Greedy, nucleus_only(5.0, 1.0, 3), nucleus_only(5.0, 0.9, 3)] {
            let held = Held { tokens: vec![2, 0], until: 50 };
            let mut s = Sampler::new(sampling, Penalties::default(), held, &[]);
            let drawn: Vec<u32> = (0..60).map(|_| s.next(&logits)).collect();
            assert!(drawn[..50].iter().all(|&t| t == 1 || t == 3), "{sampling:?}: {drawn:?}");
            assert!(drawn[50..].contains(&2), "{sampling:?}: held no longer: {drawn:?}");
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens_and_greedy_takes_the_first_largest() {
        let logits = logits(3000, 7);
        let run = |seed| {
            let mut s = Sampler::new(nucleus_only(1.2, 1.0, seed), Penalties::default(), Held::default(), &[]);
            (0..40).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
        let mut greedy = Sampler::new(Sampling::Greedy, Penalties::default(), Held::default(), &[]);
        assert_eq!(greedy.sample(&[0.5, 2.0, -1.0, 2.0], &[]), 1);
    }
}
