//! Optimizers on plain tensors (no autograd) and learning-rate schedules.

use pipewright_core::{Decay, Optimizer};
use pipewright_fused as fused;
use tch::{Device, Kind, TchError, Tensor};

use super::transport::Named;

/// The optimizer and its hyperparameters. One state per weight; with 2BW the moments see
/// the 1-stale gradient.
///
/// - SGD: `d = g + wd*w; buf = momentum*buf + d` (first step: `buf = d`); `w -= lr*buf`.
/// - Adam: L2 weight decay folded into the gradient; bias-corrected moments.
/// - AdamW: decoupled weight decay `w -= lr*wd*w`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerConfig {
    pub kind: Optimizer,
    /// SGD only.
    pub momentum: f64,
    /// Adam and AdamW.
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl OptimizerConfig {
    /// `kind` with PyTorch's default hyperparameters (no momentum, no weight decay).
    pub fn new(kind: Optimizer) -> Self {
        OptimizerConfig { kind, momentum: 0.0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }

    pub fn sgd() -> Self {
        Self::new(Optimizer::Sgd)
    }

    pub fn adam() -> Self {
        Self::new(Optimizer::Adam)
    }
}

/// Linear warm-up over `warmup_steps` (step t uses `lr*(t+1)/warmup_steps`), then
/// `decay` from the base rate to `final_lr` at step `total_steps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub warmup_steps: usize,
    pub decay: Decay,
    pub total_steps: usize,
    pub final_lr: f64,
}

impl Default for LrSchedule {
    fn default() -> Self {
        LrSchedule { warmup_steps: 0, decay: Decay::Constant, total_steps: 0, final_lr: 0.0 }
    }
}

impl LrSchedule {
    /// The learning rate of step `t` (0-based) for base rate `lr`.
    pub fn at(&self, lr: f64, t: usize) -> f64 {
        if t < self.warmup_steps {
            return lr * (t + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let frac = ((t - self.warmup_steps) as f64 / span).min(1.0);
        let final_lr = self.final_lr;
        match self.decay {
            Decay::Constant => lr,
            Decay::Linear => lr + (final_lr - lr) * frac,
            Decay::Cosine => final_lr + (lr - final_lr) * 0.5 * (1.0 + (std::f64::consts::PI * frac).cos()),
        }
    }
}

/// Per-weight optimizer state of one stage.
pub(crate) struct OptState {
    opt: OptimizerConfig,
    t: i32,
    /// SGD's momentum buffers, or Adam's first moments.
    m: Vec<Option<Tensor>>,
    /// Adam's second moments.
    v: Vec<Option<Tensor>>,
    /// The step number as a tensor on each device holding weights, counted there (Adam's
    /// bias corrections read it on the device: nothing is uploaded per step), with the
    /// step it holds.
    step_on: Vec<(Device, Tensor, i32)>,
}

impl OptState {
    pub(crate) fn new(opt: OptimizerConfig, n: usize) -> Self {
        OptState { opt, t: 0, m: (0..n).map(|_| None).collect(), v: (0..n).map(|_| None).collect(), step_on: Vec::new() }
    }

    /// New weights from `w` (the newest version) and gradient `g`, at rate `lr`. The
    /// weights are never changed in place (under 2BW the older version is still in use):
    /// they are copied, and libtorch's fused kernels update the copies and the optimizer's
    /// own state in place, one multi-tensor call per device and type.
    pub(crate) fn step(&mut self, w: &[Tensor], g: &[Tensor], lr: f64) -> Result<Vec<Tensor>, TchError> {
        tch::no_grad(|| {
            self.t += 1;
            let mut new = fused::copy_all(w)?;
            for group in groups(&new) {
                self.update_group(&group, &mut new, g, lr)?;
            }
            Ok(new)
        })
    }

    /// The fused update of the weights `idx` (one device and type) of `new`.
    fn update_group(&mut self, idx: &[usize], new: &mut [Tensor], g: &[Tensor], lr: f64) -> Result<(), TchError> {
        let OptimizerConfig { kind, momentum, beta1, beta2, eps, weight_decay } = self.opt;
        let mut params: Vec<Tensor> = idx.iter().map(|&i| new[i].shallow_clone()).collect();
        let grads = idx.iter().map(|&i| g[i].f_contiguous()).collect::<Result<Vec<_>, _>>()?;
        match kind {
            Optimizer::Sgd => {
                // Zero buffers updated give the decayed gradient too; the flag only saves the work.
                let first_step = idx.iter().all(|&i| self.m[i].is_none());
                let mut buffers = if momentum != 0.0 { state_of(&mut self.m, idx, &params)? } else { Vec::new() };
                fused::sgd_(&mut params, &grads, &mut buffers, fused::Sgd { lr, momentum, weight_decay }, first_step)
            }
            Optimizer::Adam | Optimizer::AdamW => {
                let mut m = state_of(&mut self.m, idx, &params)?;
                let mut v = state_of(&mut self.v, idx, &params)?;
                let step = self.step_tensor(params[0].device())?;
                let hp = fused::Adam { lr, beta1, beta2, eps, weight_decay, decoupled: kind == Optimizer::AdamW };
                fused::adam_(&mut params, &grads, &mut m, &mut v, &step, hp)
            }
        }
    }

    /// This step's number on `device`: made once (and again after a restore), then
    /// counted up there by one each step.
    fn step_tensor(&mut self, device: Device) -> Result<Tensor, TchError> {
        let t = self.t;
        if let Some((_, s, at)) = self.step_on.iter_mut().find(|(d, ..)| *d == device) {
            if *at + 1 == t {
                let _ = s.f_add_scalar_(1.0)?;
                *at = t;
            }
            if *at == t {
                return Ok(s.shallow_clone());
            }
        }
        let s = Tensor::f_from_slice(&[t as f32])?.f_reshape([])?.f_to_device(device)?;
        self.step_on.retain(|(d, ..)| *d != device);
        self.step_on.push((device, s.shallow_clone(), t));
        Ok(s)
    }
}

/// The indices of `ts` grouped by device and type, in order of first appearance (a fused
/// call takes tensors of one device and one type).
fn groups(ts: &[Tensor]) -> Vec<Vec<usize>> {
    let mut keys: Vec<(Device, Kind)> = Vec::new();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        let key = (t.device(), t.kind());
        match keys.iter().position(|k| *k == key) {
            Some(j) => out[j].push(i),
            None => {
                keys.push(key);
                out.push(vec![i]);
            }
        }
    }
    out
}

/// The state tensors `idx` of `slots` (zeros like the weights where there are none yet),
/// as handles that update the stored state in place.
fn state_of(slots: &mut [Option<Tensor>], idx: &[usize], like: &[Tensor]) -> Result<Vec<Tensor>, TchError> {
    idx.iter()
        .zip(like)
        .map(|(&i, w)| match &slots[i] {
            Some(s) => Ok(s.shallow_clone()),
            None => {
                let zeros = w.f_zeros_like()?;
                slots[i] = Some(zeros.shallow_clone());
                Ok(zeros)
            }
        })
        .collect()
}

/// Whether every element of `ts` is finite: one reduction per tensor and a single read
/// (a NaN or infinity anywhere makes the double-precision sum non-finite; finite f32
/// values cannot overflow it).
pub(crate) fn all_finite(ts: &[Tensor]) -> Result<bool, tch::TchError> {
    if ts.is_empty() {
        return Ok(true);
    }
    tch::no_grad(|| {
        let sums = ts.iter().map(|t| t.f_sum(Kind::Double)).collect::<Result<Vec<_>, _>>()?;
        Ok(Tensor::f_stack(&sums, 0)?.f_sum(Kind::Double)?.f_double_value(&[])?.is_finite())
    })
}

/// Milliseconds one weight's update takes as a stage's step applies it: the accumulated
/// gradient divided by the `m` microbatches in place, `opt`'s new weights (with its state
/// warm: timed from the second step on) and the finiteness check of the result; the
/// median of `reps` updates. For `pipewright profile`, which records it per weight.
pub fn update_ms(opt: OptimizerConfig, weight: &Tensor, m: usize, reps: usize) -> Result<f64, tch::TchError> {
    step_ms(opt, std::slice::from_ref(weight), m, reps)
}

/// Adds `grads` into the accumulators `acc` in place, as a stage does with each
/// microbatch's gradients after the first of a step.
pub(crate) fn accumulate(acc: &mut [Tensor], grads: &[Tensor]) -> Result<(), tch::TchError> {
    tch::no_grad(|| acc.iter_mut().zip(grads).try_for_each(|(a, g)| a.f_add_(g).map(|_| ())))
}

/// Milliseconds of one accumulation ([`accumulate`]) of a gradient of every one of
/// `weights`, median of `reps` after one warm-up. For `pipewright profile`: a stage's
/// backward pays it for every microbatch of a step but the first, a cost that neither the
/// nodes nor the whole pass (one microbatch) show.
pub fn accumulate_ms(weights: &[Tensor], reps: usize) -> Result<f64, tch::TchError> {
    let mut acc: Vec<Tensor> = weights.iter().map(|t| t.detach().f_zeros_like()).collect::<Result<_, _>>()?;
    median_after_warm_up(reps, || {
        // Fresh gradients each time, as each microbatch's backward makes its own.
        let g: Vec<Tensor> = weights.iter().map(|x| x.detach().f_randn_like()).collect::<Result<_, _>>()?;
        let start = std::time::Instant::now();
        accumulate(&mut acc, &g)?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    })
}

/// The median of `reps` (at least 1) milliseconds that `once` measures, after one more
/// that warms caches, allocators and the optimizer's state and is left out.
fn median_after_warm_up(reps: usize, mut once: impl FnMut() -> Result<f64, tch::TchError>) -> Result<f64, tch::TchError> {
    once()?;
    let mut times = (0..reps.max(1)).map(|_| once()).collect::<Result<Vec<f64>, _>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Milliseconds of one step over all of `weights` at once, as [`update_ms`] times one.
/// For `pipewright profile`: a step streams every weight, gradient and state through
/// memory in turn, where one weight updated over and over stays in the cache, so the
/// whole model's step is what the per-weight times are scaled to.
pub fn step_ms(opt: OptimizerConfig, weights: &[Tensor], m: usize, reps: usize) -> Result<f64, tch::TchError> {
    let mut state = OptState::new(opt, weights.len());
    let mut w: Vec<Tensor> = weights.iter().map(|t| t.detach().copy()).collect();
    median_after_warm_up(reps, || {
        // Fresh gradients each time, as each step has its own accumulators.
        let mut g: Vec<Tensor> = w.iter().map(|x| x.f_randn_like().and_then(|r| r.f_mul_scalar(1e-3))).collect::<Result<_, _>>()?;
        let start = std::time::Instant::now();
        if m > 1 {
            tch::no_grad(|| g.iter_mut().try_for_each(|g| g.f_div_scalar_(m as f64).map(|_| ())))?;
        }
        let new = state.step(&w, &g, 1e-4)?;
        all_finite(&new)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        w = new;
        Ok(ms)
    })
}

impl OptState {
    /// Steps taken and the per-weight state as `(name, tensor)` (names by weight index).
    pub(crate) fn export(&self, names: &[String]) -> (i32, Named, Named) {
        let pick = |xs: &[Option<Tensor>]| -> Vec<(String, Tensor)> {
            // Copies: the state is updated in place by later steps.
            names.iter().zip(xs).filter_map(|(n, x)| x.as_ref().map(|t| (n.clone(), t.copy()))).collect()
        };
        (self.t, pick(&self.m), pick(&self.v))
    }

    /// Restores what [`OptState::export`] gave, checking names and shapes against `w`.
    pub(crate) fn restore(&mut self, steps: i32, names: &[String], w: &[Tensor], m: &[(String, Tensor)], v: &[(String, Tensor)]) -> Result<(), String> {
        self.t = steps;
        self.step_on.clear();
        for (list, slots, what) in [(m, &mut self.m, "opt.m"), (v, &mut self.v, "opt.v")] {
            for (name, t) in list {
                let i = names.iter().position(|n| n == name).ok_or_else(|| format!("{what}/{name}: no such weight in this stage"))?;
                if t.size() != w[i].size() {
                    return Err(format!("{what}/{name}: shape {:?}, the weight has {:?}", t.size(), w[i].size()));
                }
                slots[i] = Some(t.to_device(w[i].device()));
            }
        }
        Ok(())
    }

    /// Bytes of the optimizer state held.
    pub(crate) fn bytes(&self) -> u64 {
        self.m.iter().chain(&self.v).flatten().map(super::memory::bytes_of).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The update rules written out per weight with plain tensor ops in double precision
    /// (the per-weight loop the fused kernels replaced), for `steps` steps.
    fn reference(opt: OptimizerConfig, w: &[Tensor], grads: &[Vec<Tensor>], lr: f64) -> Vec<Tensor> {
        let OptimizerConfig { kind, momentum, beta1, beta2, eps, weight_decay: wd } = opt;
        let mut w: Vec<Tensor> = w.iter().map(|x| x.to_kind(Kind::Double)).collect();
        let mut m: Vec<Option<Tensor>> = w.iter().map(|_| None).collect();
        let mut v: Vec<Option<Tensor>> = w.iter().map(|_| None).collect();
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            for i in 0..w.len() {
                let g = g[i].to_kind(Kind::Double);
                w[i] = match kind {
                    Optimizer::Sgd => {
                        let d = &g + &w[i] * wd;
                        let buf = match m[i].take() {
                            None => d,
                            Some(b) => b * momentum + d,
                        };
                        m[i] = Some(buf.shallow_clone());
                        &w[i] - buf * lr
                    }
                    Optimizer::Adam | Optimizer::AdamW => {
                        let decoupled = kind == Optimizer::AdamW;
                        let g = if decoupled { g } else { &g + &w[i] * wd };
                        let mi = m[i].take().map_or_else(|| &g * (1.0 - beta1), |m| m * beta1 + &g * (1.0 - beta1));
                        let vi = v[i].take().map_or_else(|| &g * &g * (1.0 - beta2), |v| v * beta2 + &g * &g * (1.0 - beta2));
                        let (bc1, bc2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
                        let upd = &mi / ((&vi / bc2).sqrt() + eps);
                        m[i] = Some(mi);
                        v[i] = Some(vi);
                        let base = if decoupled { &w[i] * (1.0 - lr * wd) } else { w[i].shallow_clone() };
                        base - upd * (lr / bc1)
                    }
                };
            }
        }
        w
    }

    fn largest_relative_gap(a: &[Tensor], b: &[Tensor]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(a, b)| {
                let a = a.to_kind(Kind::Double);
                let gap = (&a - b.to_kind(Kind::Double)).abs().max().double_value(&[]);
                gap / a.abs().max().double_value(&[]).max(1e-12)
            })
            .fold(0.0, f64::max)
    }

    /// 50 fused steps of every optimizer, with momentum and weight decay, on weights of
    /// two types, against the per-weight rules: the same within fp32 rounding, and the
    /// weights handed in are never changed (2BW still uses them).
    #[test]
    fn fused_steps_follow_the_per_weight_rules_within_rounding() {
        tch::manual_seed(7);
        let w0 = vec![Tensor::randn([64, 32], (Kind::Float, Device::Cpu)), Tensor::randn([17], (Kind::Float, Device::Cpu)), Tensor::randn([3, 5, 7], (Kind::Double, Device::Cpu))];
        let grads: Vec<Vec<Tensor>> = (0..50).map(|_| w0.iter().map(|w| w.randn_like() * 0.1).collect()).collect();
        let sgd = OptimizerConfig { momentum: 0.9, weight_decay: 1e-2, ..OptimizerConfig::sgd() };
        let adam = OptimizerConfig { weight_decay: 1e-2, ..OptimizerConfig::adam() };
        let adamw = OptimizerConfig { kind: Optimizer::AdamW, ..adam };
        for (opt, lr) in [(OptimizerConfig::sgd(), 0.05), (sgd, 0.05), (adam, 1e-2), (adamw, 1e-2)] {
            let mut state = OptState::new(opt, w0.len());
            let before: Vec<Tensor> = w0.iter().map(Tensor::copy).collect();
            let mut w: Vec<Tensor> = w0.iter().map(Tensor::shallow_clone).collect();
            for g in &grads {
                w = state.step(&w, g, lr).expect("a fused step");
            }
            let gap = largest_relative_gap(&reference(opt, &w0, &grads, lr), &w);
            assert!(gap < 1e-5, "{opt:?}: largest relative gap to the per-weight rules {gap:e}");
            assert!(w[2].kind() == Kind::Double && w[0].kind() == Kind::Float, "types kept");
            assert_eq!(largest_relative_gap(&before, &w0), 0.0, "{opt:?} changed the weights it was given");
        }
    }

    /// A checkpoint's state restored into a new optimizer continues exactly where the
    /// first left off (the step counter on the device included).
    #[test]
    fn restored_state_continues_bit_identically() {
        tch::manual_seed(3);
        let names = vec!["a".to_string(), "b".to_string()];
        let w0 = vec![Tensor::randn([8, 4], (Kind::Float, Device::Cpu)), Tensor::randn([5], (Kind::Float, Device::Cpu))];
        let grads: Vec<Vec<Tensor>> = (0..6).map(|_| w0.iter().map(|w| w.randn_like()).collect()).collect();
        let opt = OptimizerConfig { weight_decay: 1e-2, ..OptimizerConfig::adam() };
        let run = |state: &mut OptState, w: Vec<Tensor>, gs: &[Vec<Tensor>]| gs.iter().fold(w, |w, g| state.step(&w, g, 1e-2).expect("a fused step"));
        let mut straight = OptState::new(opt, 2);
        let whole = run(&mut straight, w0.iter().map(Tensor::shallow_clone).collect(), &grads);
        let mut first = OptState::new(opt, 2);
        let half = run(&mut first, w0.iter().map(Tensor::shallow_clone).collect(), &grads[..3]);
        let (steps, m, v) = first.export(&names);
        let mut resumed = OptState::new(opt, 2);
        resumed.restore(steps, &names, &half, &m, &v).expect("restore");
        let rest = run(&mut resumed, half, &grads[3..]);
        assert_eq!(largest_relative_gap(&whole, &rest), 0.0);
    }

    /// A stage without weights (a tail of parameter-free nodes) steps over nothing.
    #[test]
    fn a_stage_without_weights_steps_over_nothing() {
        for opt in [OptimizerConfig::sgd(), OptimizerConfig { momentum: 0.9, ..OptimizerConfig::sgd() }, OptimizerConfig::adam()] {
            let mut state = OptState::new(opt, 0);
            assert!(state.step(&[], &[], 0.1).expect("an empty step").is_empty(), "{opt:?}");
        }
    }

    #[test]
    fn lists_of_different_lengths_are_refused_with_a_message() {
        let w = vec![Tensor::zeros([2], (Kind::Float, Device::Cpu))];
        let err = fused::sgd_(&mut w.iter().map(Tensor::shallow_clone).collect::<Vec<_>>(), &[], &mut [], fused::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 }, true).expect_err("no gradients");
        assert!(err.to_string().contains("1 weights but a list of 0"), "{err}");
    }
}
