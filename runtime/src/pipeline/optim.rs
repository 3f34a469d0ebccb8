//! Optimizers on plain tensors (no autograd) and learning-rate schedules.

use pipewright_core::{Decay, Optimizer};
use tch::{Kind, Tensor};

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
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl OptState {
    pub(crate) fn new(opt: OptimizerConfig, n: usize) -> Self {
        OptState { opt, t: 0, m: (0..n).map(|_| None).collect(), v: (0..n).map(|_| None).collect() }
    }

    /// New weights from `w` (the newest version) and gradient `g`, at rate `lr`. The
    /// weights are never changed in place (under 2BW the older version is still in use);
    /// the optimizer's own state is, so each update allocates one new tensor per weight
    /// (and Adam one temporary), which matters on large models.
    pub(crate) fn step(&mut self, w: &[Tensor], g: &[Tensor], lr: f64) -> Vec<Tensor> {
        tch::no_grad(|| {
            self.t += 1;
            let t = self.t;
            let mut scalars = Scalars::default();
            w.iter().zip(g).enumerate().map(|(i, (w, g))| self.update(i, w, g, lr, t, &mut scalars)).collect()
        })
    }

    fn update(&mut self, i: usize, w: &Tensor, g: &Tensor, lr: f64, t: i32, scalars: &mut Scalars) -> Tensor {
        // `w + a * b` with a scalar `a`, in one pass and one allocation; `a` is uploaded
        // once per step and kind, not once per weight.
        let mut axpy = |w: &Tensor, a: f64, b: &Tensor| w.addcmul(b, &scalars.get(a, b));
        let OptimizerConfig { kind, momentum, beta1, beta2, eps, weight_decay } = self.opt;
        match kind {
            Optimizer::Sgd => {
                let d = if weight_decay != 0.0 { axpy(g, weight_decay, w) } else { g.shallow_clone() };
                let d = if momentum != 0.0 {
                    let buf = match self.m[i].take() {
                        None => d.copy(),
                        Some(mut b) => {
                            let _ = b.f_mul_scalar_(momentum).and_then(|mut b| b.f_add_(&d));
                            b
                        }
                    };
                    self.m[i] = Some(buf.shallow_clone());
                    buf
                } else {
                    d
                };
                axpy(w, -lr, &d)
            }
            Optimizer::Adam | Optimizer::AdamW => {
                let decoupled = kind == Optimizer::AdamW;
                let g = if !decoupled && weight_decay != 0.0 { axpy(g, weight_decay, w) } else { g.shallow_clone() };
                // m = beta1*m + (1-beta1)*g and v = beta2*v + (1-beta2)*g^2, in place.
                let m = match self.m[i].take() {
                    None => &g * (1.0 - beta1),
                    Some(mut m) => {
                        let _ = m.f_lerp_(&g, 1.0 - beta1);
                        m
                    }
                };
                let v = match self.v[i].take() {
                    None => &g * &g * (1.0 - beta2),
                    Some(mut v) => {
                        let _ = v.f_lerp_(&(&g * &g), 1.0 - beta2);
                        v
                    }
                };
                let (bc1, bc2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
                let mut denom = &v / bc2;
                let _ = denom.f_sqrt_().and_then(|mut d| d.f_add_scalar_(eps));
                let upd = &m / &denom;
                self.m[i] = Some(m);
                self.v[i] = Some(v);
                let base = if decoupled && weight_decay != 0.0 { w * (1.0 - lr * weight_decay) } else { w.shallow_clone() };
                axpy(&base, -lr / bc1, &upd)
            }
        }
    }
}

/// The scalars of one optimizer step on the weights' devices, each uploaded once (a
/// host-to-device copy per weight would stall a GPU's stream once per weight).
#[derive(Default)]
struct Scalars {
    made: Vec<(u64, Kind, tch::Device, Tensor)>,
}

impl Scalars {
    /// `a` as a 0-d tensor of `like`'s kind on its device.
    fn get(&mut self, a: f64, like: &Tensor) -> Tensor {
        let (kind, device) = (like.kind(), like.device());
        if let Some((.., t)) = self.made.iter().find(|(v, k, d, _)| *v == a.to_bits() && *k == kind && *d == device) {
            return t.shallow_clone();
        }
        let t = Tensor::from(a).to_kind(kind).to_device(device);
        self.made.push((a.to_bits(), kind, device, t.shallow_clone()));
        t
    }
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
        let new = state.step(&w, &g, 1e-4);
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
    pub(crate) fn restore(
        &mut self,
        steps: i32,
        names: &[String],
        w: &[Tensor],
        m: &[(String, Tensor)],
        v: &[(String, Tensor)],
    ) -> Result<(), String> {
        self.t = steps;
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
