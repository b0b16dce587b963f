//! Log-probabilities of generated tokens, for the API's `logprobs`: under the model's own distribution
//! (a log-softmax of its raw logits, before any penalty, bias or temperature), as vLLM reports them by
//! default, so a token's figure does not depend on how it was drawn.

/// The most alternatives a request may ask for at each step (vLLM's default `max_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What OpenAI's API reports for a log-probability of minus infinity (JSON has no infinity).
const FLOOR: f32 = -9999.0;

/// One generated token's log-probability, and the most likely tokens' at that step.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token generated.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first (the lower id first on
    /// ties): as many as the request asked for.
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability under `logits`, and the `top` most likely tokens'. The softmax's
/// normaliser is summed in f64 over the whole vocabulary (NaNs left out) by the model's vectorised
/// [`model::kernels::sum_exp`], in one fixed order on every CPU: a scalar `expf` per logit took 1.6-2.8 ms
/// of each decode step for Gemma 3's 262144 logits.
pub(super) fn of(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum =
        if max.is_finite() { f64::from(max) + model::kernels::sum_exp(logits, max).ln() } else { f64::from(max) };
    let lp = |x: f32| {
        let v = (f64::from(x) - log_sum) as f32;
        if v.is_nan() {
            v
        } else {
            v.max(FLOOR)
        }
    };
    // The `top` largest, kept sorted (largest first) as the logits pass: a later token enters only if
    // strictly larger than one kept, so ties keep the lower id first. NaNs never enter.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (id, &x) in logits.iter().enumerate() {
            if best.len() == top && best.last().is_none_or(|&(_, y)| x <= y) {
                continue;
            }
            if x.is_nan() {
                continue;
            }
            let at = best.partition_point(|&(_, y)| y >= x);
            best.insert(at, (id as u32, x));
            best.truncate(top);
        }
    }
    TokenLogprob {
        token,
        logprob: logits.get(token as usize).map_or(f32::NAN, |&x| lp(x)),
        top: best.into_iter().map(|(id, x)| (id, lp(x))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probabilities_are_a_log_softmax_and_the_top_are_the_largest_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let norm: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        let want = |x: f32| (f64::from(x) - norm.ln()) as f32;
        let t = of(&logits, 2, 3);
        assert_eq!(t.token, 2);
        assert!((t.logprob - want(2.0)).abs() < 1e-6, "{} against {}", t.logprob, want(2.0));
        // 3.0 twice: the lower id first; then 2.0.
        assert_eq!(t.top.iter().map(|&(id, _)| id).collect::<Vec<_>>(), [1, 3, 2]);
        for &(id, lp) in &t.top {
            assert!((lp - want(logits[id as usize])).abs() < 1e-6);
        }
        let total: f64 = logits.iter().map(|&x| f64::from(want(x)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(of(&logits, 0, 0).top.is_empty());
        assert_eq!(of(&logits, 0, 9).top.len(), logits.len(), "no more than the vocabulary");
    }

    #[test]
    fn huge_logits_stay_finite_and_minus_infinity_is_openais_floor() {
        let logits = [1e30f32, 0.0, f32::NEG_INFINITY, f32::NAN];
        let t = of(&logits, 2, 4);
        assert_eq!(t.logprob, FLOOR);
        assert_eq!(t.top[0], (0, 0.0));
        assert_eq!(t.top[1], (1, FLOOR), "exp(-1e30) is 0: the floor, not -1e30");
        assert_eq!(t.top.len(), 3, "a NaN is never among the most likely");
    }
}
