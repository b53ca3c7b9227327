//! The candle adapter on a 2-layer MLP: gradients arrive bit-exact, a step through the flat
//! buffers equals the same step written with candle ops, AdamW agrees with `candle_nn::AdamW`,
//! and seeded initialisation is reproducible.
#![cfg(feature = "candle")]

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer as _;
use rand::{rngs::StdRng, Rng, SeedableRng};
use starling_training::{
    AdamW, AdamWConfig, BindError, Init, Optimizer, ParamSet, Sgd, SgdConfig, VarBinding,
};

const IN: usize = 6;
const HIDDEN: usize = 12;
const OUT: usize = 3;
const BATCH: usize = 16;

struct Mlp {
    w1: Var,
    b1: Var,
    w2: Var,
    b2: Var,
}

impl Mlp {
    fn zeros() -> Mlp {
        let dev = Device::Cpu;
        let z = |shape: &[usize]| Var::zeros(shape, DType::F32, &dev).unwrap();
        Mlp {
            w1: z(&[HIDDEN, IN]),
            b1: z(&[HIDDEN]),
            w2: z(&[OUT, HIDDEN]),
            b2: z(&[OUT]),
        }
    }

    fn named(&self) -> Vec<(&'static str, Var)> {
        vec![
            ("l1.weight", self.w1.clone()),
            ("l1.bias", self.b1.clone()),
            ("l2.weight", self.w2.clone()),
            ("l2.bias", self.b2.clone()),
        ]
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
        let h = x
            .matmul(&self.w1.t().unwrap())
            .unwrap()
            .broadcast_add(&self.b1)
            .unwrap()
            .relu()
            .unwrap();
        let out = h
            .matmul(&self.w2.t().unwrap())
            .unwrap()
            .broadcast_add(&self.b2)
            .unwrap();
        (out - y).unwrap().sqr().unwrap().mean_all().unwrap()
    }
}

fn init_rule(t: &starling_training::TensorInfo) -> Init {
    if t.shape().len() == 1 {
        Init::torch_bias(if t.name().starts_with("l1") {
            IN
        } else {
            HIDDEN
        })
    } else {
        Init::KaimingUniform
    }
}

fn setup(seed: u64) -> (Mlp, ParamSet, VarBinding) {
    let mlp = Mlp::zeros();
    let mut set = ParamSet::new();
    let binding = VarBinding::register(&mut set, mlp.named()).unwrap();
    binding
        .initialize(&mut set, &mut StdRng::seed_from_u64(seed), init_rule)
        .unwrap();
    (mlp, set, binding)
}

fn batch(seed: u64) -> (Tensor, Tensor) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rand = |n: usize| {
        (0..n)
            .map(|_| rng.gen_range(-1.0f32..1.0))
            .collect::<Vec<_>>()
    };
    let x = Tensor::from_vec(rand(BATCH * IN), (BATCH, IN), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(rand(BATCH * OUT), (BATCH, OUT), &Device::Cpu).unwrap();
    (x, y)
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn seeded_init_is_reproducible_and_lands_in_the_vars() {
    let (mlp_a, set_a, _) = setup(7);
    let (mlp_b, _, _) = setup(7);
    let (mlp_c, _, _) = setup(8);
    for ((a, b), c) in mlp_a.named().iter().zip(mlp_b.named()).zip(mlp_c.named()) {
        assert_eq!(values(&a.1), values(&b.1), "{}", a.0);
        assert_ne!(values(&a.1), values(&c.1), "{}", a.0);
        assert_eq!(values(&a.1), set_a.tensor(a.0).unwrap());
    }
    let bound = (6.0f32 / IN as f32).sqrt();
    assert!(values(&mlp_a.w1).iter().all(|v| v.abs() <= bound));
}

/// Gradients copied through the binding are candle's bits; an SGD-with-momentum step through the
/// flat buffers equals `w - lr * g` written with candle ops (first momentum step: buf = g) to
/// within 1e-7 (both are one f32 multiply and one subtract; measured bit-equal).
#[test]
fn a_step_through_the_binding_equals_a_manual_step() {
    let (mlp, mut set, binding) = setup(1);
    let (x, y) = batch(2);
    let grads = mlp.loss(&x, &y).backward().unwrap();
    binding.grads_to_set(&grads, &mut set).unwrap();
    let lr = 0.05;
    let mut manual = Vec::new();
    for (name, var) in mlp.named() {
        let g = grads.get(&var).unwrap();
        assert_eq!(values(g), set.grad(name).unwrap(), "{name}: gradient bits");
        manual.push((
            name,
            values(&(var.as_tensor() - (g * lr).unwrap()).unwrap()),
        ));
    }
    let mut opt = Sgd::new(SgdConfig::new(lr).momentum(0.9), set.len()).unwrap();
    opt.step_set(&mut set).unwrap();
    binding.params_to_vars(&set).unwrap();
    for ((name, var), (_, want)) in mlp.named().into_iter().zip(manual) {
        let got = values(&var);
        assert!(
            max_abs_diff(&got, &want) <= 1e-7,
            "{name}: {}",
            max_abs_diff(&got, &want)
        );
    }
}

/// Ten AdamW steps through the binding track `candle_nn::AdamW` on an identical model: both
/// implement PyTorch's AdamW in f32 with differently ordered scalars; measured 6e-8 apart, held to 1e-6.
#[test]
fn adamw_through_the_binding_tracks_candle_nn() {
    let (mlp, mut set, binding) = setup(3);
    let (twin, _, _) = setup(3);
    let cfg = AdamWConfig::new(1e-2).weight_decay(0.05);
    let mut ours = AdamW::new(cfg, set.len()).unwrap();
    let params = candle_nn::ParamsAdamW {
        lr: cfg.lr,
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        eps: cfg.eps,
        weight_decay: cfg.weight_decay,
    };
    let twin_vars: Vec<Var> = twin.named().into_iter().map(|(_, v)| v).collect();
    let mut theirs = candle_nn::AdamW::new(twin_vars, params).unwrap();
    let mut first_loss = None;
    let mut last_loss = 0.0;
    for step in 0..10 {
        let (x, y) = batch(100 + step);
        let loss = mlp.loss(&x, &y);
        last_loss = loss.to_scalar::<f32>().unwrap();
        first_loss.get_or_insert(last_loss);
        binding
            .grads_to_set(&loss.backward().unwrap(), &mut set)
            .unwrap();
        ours.step_set(&mut set).unwrap();
        binding.params_to_vars(&set).unwrap();
        theirs.backward_step(&twin.loss(&x, &y)).unwrap();
    }
    for ((name, a), (_, b)) in mlp.named().into_iter().zip(twin.named()) {
        let d = max_abs_diff(&values(&a), &values(&b));
        assert!(d <= 1e-6, "{name}: ours and candle_nn differ by {d}");
    }
    assert!(
        first_loss.is_some_and(|f| last_loss < f),
        "training on fresh batches still lowers the loss"
    );
}

#[test]
fn accumulating_micro_batches_sums_their_gradients() {
    let (mlp, mut set, binding) = setup(4);
    let (x1, y1) = batch(5);
    let (x2, y2) = batch(6);
    let g1 = mlp.loss(&x1, &y1).backward().unwrap();
    let g2 = mlp.loss(&x2, &y2).backward().unwrap();
    set.zero_grads();
    binding.accumulate_grads(&g1, &mut set).unwrap();
    binding.accumulate_grads(&g2, &mut set).unwrap();
    for (name, var) in mlp.named() {
        let want: Vec<f32> = values(g1.get(&var).unwrap())
            .iter()
            .zip(values(g2.get(&var).unwrap()))
            .map(|(a, b)| a + b)
            .collect();
        assert_eq!(set.grad(name).unwrap(), &want[..], "{name}");
    }
}

/// A var the loss does not reach is an error naming every such var, and nothing is written
/// (a graph cut by an op without a backward trained only the layers above it, silently); vars
/// declared frozen get zeros instead.
#[test]
fn vars_the_loss_does_not_reach_are_an_error_unless_frozen() {
    let (mlp, mut set, mut binding) = setup(5);
    set.grads_mut().fill(1.0);
    let grads = mlp.w1.as_tensor().sum_all().unwrap().backward().unwrap();
    for accumulate in [false, true] {
        let err = if accumulate {
            binding.accumulate_grads(&grads, &mut set)
        } else {
            binding.grads_to_set(&grads, &mut set)
        }
        .unwrap_err();
        match &err {
            BindError::MissingGradients { names } => {
                assert_eq!(names, &["l1.bias", "l2.weight", "l2.bias"], "{err}")
            }
            other => panic!("wrong error: {other}"),
        }
        assert!(err.to_string().contains("l2.weight"), "{err}");
        assert!(set.grads().iter().all(|&g| g == 1.0), "nothing written");
    }
    // Freezing a name the binding does not hold is an error too.
    assert!(matches!(
        binding.freeze(["l3.weight"]),
        Err(BindError::UnknownVar { .. })
    ));
    binding.freeze(["l1.bias", "l2.bias", "l2.weight"]).unwrap();
    assert_eq!(binding.frozen().count(), 3);
    binding.grads_to_set(&grads, &mut set).unwrap();
    assert!(set.grad("l1.weight").unwrap().iter().all(|&g| g == 1.0));
    assert!(set.grad("l2.weight").unwrap().iter().all(|&g| g == 0.0));
    binding.accumulate_grads(&grads, &mut set).unwrap();
    assert!(set.grad("l1.weight").unwrap().iter().all(|&g| g == 2.0));
    assert!(set.grad("l2.weight").unwrap().iter().all(|&g| g == 0.0));
}

#[test]
fn other_dtypes_pass_through_f32_and_mismatches_are_errors() {
    let dev = Device::Cpu;
    let half = Var::from_tensor(
        &Tensor::new(&[1.5f32, -2.0], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap(),
    )
    .unwrap();
    let mut set = ParamSet::new();
    let binding = VarBinding::register(&mut set, [("h", half.clone())]).unwrap();
    assert_eq!(set.params(), &[1.5, -2.0]);
    set.params_mut().copy_from_slice(&[0.25, 4.0]);
    binding.params_to_vars(&set).unwrap();
    assert_eq!(half.dtype(), DType::BF16);
    assert_eq!(values(&half.to_dtype(DType::F32).unwrap()), [0.25, 4.0]);

    let ints = Var::from_tensor(&Tensor::new(&[1u32, 2], &dev).unwrap()).unwrap();
    let err = VarBinding::register(&mut ParamSet::new(), [("i", ints)]).unwrap_err();
    assert!(matches!(err, BindError::Dtype { .. }), "{err}");

    let wrong = Var::zeros((2, 1), DType::F32, &dev).unwrap();
    let err = VarBinding::bind(&set, [("h", wrong)]).unwrap_err();
    assert!(matches!(err, BindError::Shape { .. }), "{err}");
    // A binding refuses a set with another layout instead of writing to the wrong place.
    let mut other = ParamSet::new();
    other.add_zeros("x", &[1]).unwrap();
    other.add_zeros("h", &[2]).unwrap();
    let err = binding.params_to_vars(&other).unwrap_err();
    assert!(matches!(err, BindError::Layout { .. }), "{err}");
}
