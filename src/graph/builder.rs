//! A small ONNX graph builder with reverse-mode differentiation.
//!
//! Forward ops are recorded on a tape; [`Graph::grad`] walks it backwards and emits, for every op
//! on a path from a trainable input to the loss, the nodes of its vector-Jacobian product. The
//! result is an ordinary inference graph whose outputs include the gradients, so ONNX Runtime's
//! CPU or CUDA execution provider runs a training step without its training build.
//!
//! Broadcasting is deliberately limited: element-wise operands have the same shape, one of them
//! is a rank-0 scalar, an operand that needs no gradient has a lower rank (ONNX broadcasts it),
//! or the caller names the axes along which an operand has size 1 (`*_bc`: its gradient is
//! summed over them). Matrix products take operands of the same rank ≥ 2 (batched over the
//! leading axes).

use std::collections::HashMap;

use prost::Message;

use super::onnx::*;

/// Element type of the floating-point values of a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// float32
    F32,
    /// float64 (tests)
    F64,
}

impl Elem {
    fn code(self) -> i32 {
        match self {
            Elem::F32 => 1,
            Elem::F64 => 11,
        }
    }
    fn bytes(self, x: f64) -> Vec<u8> {
        match self {
            Elem::F32 => (x as f32).to_le_bytes().to_vec(),
            Elem::F64 => x.to_le_bytes().to_vec(),
        }
    }
}

/// A dimension of an input: fixed or symbolic (named, e.g. `T`).
#[derive(Debug, Clone)]
pub enum Dim {
    /// known size
    Fixed(i64),
    /// size given at run time
    Sym(&'static str),
}

/// A handle to a value of the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct V(usize);

#[derive(Debug, Clone)]
enum Op {
    MatMul,
    Transpose,
    Add,
    Sub,
    Mul,
    Exp,
    Log,
    Neg,
    Sigmoid,
    Min,
    Max,
    LogSoftmax,
    GatherElements,
    ReduceSumAll,
    ReduceSumLast,
    Reshape,
    StopGradient,
    Div,
    Sqrt,
    Softmax,
    Permute(Vec<i64>),
    StraightThrough,
}

struct Rec {
    op: Op,
    inputs: Vec<V>,
    output: V,
    /// per operand: the axes along which it was broadcast (size 1 in it, kept as size 1)
    bcast: [Vec<i64>; 2],
}

struct Value {
    name: String,
    rank: usize,
    needs_grad: bool,
}

/// The graph under construction.
pub struct Graph {
    elem: Elem,
    values: Vec<Value>,
    nodes: Vec<NodeProto>,
    tape: Vec<Rec>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    initializers: Vec<TensorProto>,
    consts: HashMap<u64, V>,
}

fn attr_int(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        i,
        r#type: 2,
        ..Default::default()
    }
}

fn attr_ints(name: &str, ints: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        ints: ints.to_vec(),
        r#type: 7,
        ..Default::default()
    }
}

/// The permutation that swaps the last two of `rank` axes.
fn swap_last2(rank: usize) -> Vec<i64> {
    let mut p: Vec<i64> = (0..rank as i64).collect();
    p.swap(rank - 2, rank - 1);
    p
}

fn value_info(name: &str, elem: i32, dims: &[Dim]) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TensorTypeProto {
                elem_type: elem,
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| match d {
                            Dim::Fixed(n) => Dimension {
                                dim_value: Some(*n),
                                dim_param: None,
                            },
                            Dim::Sym(s) => Dimension {
                                dim_value: None,
                                dim_param: Some((*s).into()),
                            },
                        })
                        .collect(),
                }),
            }),
        }),
    }
}

impl Graph {
    /// An empty graph of element type `elem`.
    pub fn new(elem: Elem) -> Self {
        Graph {
            elem,
            values: Vec::new(),
            nodes: Vec::new(),
            tape: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            initializers: Vec::new(),
            consts: HashMap::new(),
        }
    }

    fn value(&mut self, rank: usize, needs_grad: bool) -> V {
        let v = V(self.values.len());
        self.values.push(Value {
            name: format!("v{}", v.0),
            rank,
            needs_grad,
        });
        v
    }

    fn name(&self, v: V) -> String {
        self.values[v.0].name.clone()
    }

    fn rank(&self, v: V) -> usize {
        self.values[v.0].rank
    }

    fn node(
        &mut self,
        op_type: &str,
        inputs: &[String],
        rank: usize,
        attrs: Vec<AttributeProto>,
    ) -> V {
        let out = self.value(rank, false);
        let name = self.name(out);
        self.nodes.push(NodeProto {
            input: inputs.to_vec(),
            output: vec![name.clone()],
            name: format!("n{}", self.nodes.len()),
            op_type: op_type.into(),
            attribute: attrs,
        });
        out
    }

    fn record(&mut self, op: Op, inputs: &[V], out: V) -> V {
        self.record_bc(op, inputs, out, [Vec::new(), Vec::new()])
    }

    fn record_bc(&mut self, op: Op, inputs: &[V], out: V, bcast: [Vec<i64>; 2]) -> V {
        let grad = match op {
            Op::StopGradient => false,
            _ => inputs.iter().any(|v| self.values[v.0].needs_grad),
        };
        self.values[out.0].needs_grad = grad;
        self.tape.push(Rec {
            op,
            inputs: inputs.to_vec(),
            output: out,
            bcast,
        });
        out
    }

    fn needs_grad(&self, v: V) -> bool {
        self.values[v.0].needs_grad
    }

    /// A floating-point graph input; `trainable` inputs get gradients from [`Graph::grad`].
    pub fn input(&mut self, name: &str, dims: &[Dim], trainable: bool) -> V {
        let v = self.value(dims.len(), trainable);
        self.values[v.0].name = name.into();
        self.inputs.push(value_info(name, self.elem.code(), dims));
        v
    }

    /// An int64 graph input (indices).
    pub fn input_i64(&mut self, name: &str, dims: &[Dim]) -> V {
        let v = self.value(dims.len(), false);
        self.values[v.0].name = name.into();
        self.inputs.push(value_info(name, 7, dims));
        v
    }

    /// A rank-0 constant.
    pub fn scalar(&mut self, x: f64) -> V {
        if let Some(v) = self.consts.get(&x.to_bits()) {
            return *v;
        }
        let v = self.value(0, false);
        let name = format!("c{}", v.0);
        self.values[v.0].name = name.clone();
        self.initializers.push(TensorProto {
            dims: vec![],
            data_type: self.elem.code(),
            name,
            raw_data: self.elem.bytes(x),
        });
        self.consts.insert(x.to_bits(), v);
        v
    }

    fn i64_const(&mut self, xs: &[i64]) -> String {
        let v = self.value(1, false);
        let name = format!("i{}", v.0);
        self.initializers.push(TensorProto {
            dims: vec![xs.len() as i64],
            data_type: 7,
            name: name.clone(),
            raw_data: xs.iter().flat_map(|x| x.to_le_bytes()).collect(),
        });
        name
    }

    /// A constant int64 tensor (indices).
    pub fn const_i64(&mut self, xs: &[i64], dims: &[i64]) -> V {
        let v = self.value(dims.len(), false);
        let name = format!("k{}", v.0);
        self.values[v.0].name = name.clone();
        self.initializers.push(TensorProto {
            dims: dims.to_vec(),
            data_type: 7,
            name,
            raw_data: xs.iter().flat_map(|x| x.to_le_bytes()).collect(),
        });
        v
    }

    /// A constant tensor of the graph's element type (frozen weights), stored in the model.
    pub fn constant(&mut self, name: &str, dims: &[usize], data: &[f32]) -> V {
        assert_eq!(
            dims.iter().product::<usize>(),
            data.len(),
            "{name}: data does not fill its shape"
        );
        let v = self.value(dims.len(), false);
        self.values[v.0].name = name.into();
        let raw_data = match self.elem {
            Elem::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Elem::F64 => data
                .iter()
                .flat_map(|&x| f64::from(x).to_le_bytes())
                .collect(),
        };
        self.initializers.push(TensorProto {
            dims: dims.iter().map(|&d| d as i64).collect(),
            data_type: self.elem.code(),
            name: name.into(),
            raw_data,
        });
        v
    }

    /// Marks a value as a graph output under `name`.
    pub fn output(&mut self, v: V, name: &str) {
        let src = self.name(v);
        self.nodes.push(NodeProto {
            input: vec![src],
            output: vec![name.into()],
            name: format!("out_{name}"),
            op_type: "Identity".into(),
            attribute: vec![],
        });
        self.outputs.push(ValueInfoProto {
            name: name.into(),
            r#type: Some(TypeProto {
                tensor_type: Some(TensorTypeProto {
                    elem_type: self.elem.code(),
                    shape: None,
                }),
            }),
        });
    }

    fn unary(&mut self, op: Op, ty: &str, a: V, attrs: Vec<AttributeProto>) -> V {
        let r = self.rank(a);
        let out = self.node(ty, &[self.name(a)], r, attrs);
        self.record(op, &[a], out)
    }

    fn binary(&mut self, op: Op, ty: &str, a: V, b: V) -> V {
        self.binary_bc(op, ty, a, b, [Vec::new(), Vec::new()])
    }

    fn binary_bc(&mut self, op: Op, ty: &str, a: V, b: V, bcast: [Vec<i64>; 2]) -> V {
        let (ra, rb) = (self.rank(a), self.rank(b));
        let lower_is_constant =
            (ra < rb && !self.needs_grad(a)) || (rb < ra && !self.needs_grad(b));
        assert!(
            ra == rb || ra == 0 || rb == 0 || lower_is_constant,
            "{ty}: ranks {ra} and {rb} do not broadcast here"
        );
        let out = self.node(ty, &[self.name(a), self.name(b)], ra.max(rb), vec![]);
        self.record_bc(op, &[a, b], out, bcast)
    }

    /// `a · b` for operands of the same rank ≥ 2 (batched over leading axes).
    pub fn matmul(&mut self, a: V, b: V) -> V {
        let (ra, rb) = (self.rank(a), self.rank(b));
        assert!(ra == rb && ra >= 2, "matmul of ranks {ra} and {rb}");
        let out = self.node("MatMul", &[self.name(a), self.name(b)], ra, vec![]);
        self.record(Op::MatMul, &[a, b], out)
    }
    /// Axes permuted as in ONNX `Transpose` with `perm`.
    pub fn permute(&mut self, a: V, perm: &[i64]) -> V {
        assert_eq!(perm.len(), self.rank(a), "permutation of the wrong rank");
        let out = self.node(
            "Transpose",
            &[self.name(a)],
            perm.len(),
            vec![attr_ints("perm", perm)],
        );
        self.record(Op::Permute(perm.to_vec()), &[a], out)
    }
    /// `a / b`.
    pub fn div(&mut self, a: V, b: V) -> V {
        self.binary(Op::Div, "Div", a, b)
    }
    /// `√a`.
    pub fn sqrt(&mut self, a: V) -> V {
        self.unary(Op::Sqrt, "Sqrt", a, vec![])
    }
    /// Softmax over the last axis.
    pub fn softmax(&mut self, a: V) -> V {
        self.unary(Op::Softmax, "Softmax", a, vec![attr_int("axis", -1)])
    }
    /// `a ⊙ b` where `b` has size 1 along `b_axes` (same rank as `a`).
    pub fn mul_bc(&mut self, a: V, b: V, b_axes: &[i64]) -> V {
        self.binary_bc(Op::Mul, "Mul", a, b, [Vec::new(), b_axes.to_vec()])
    }
    /// `a / b` where `b` has size 1 along `b_axes` (same rank as `a`).
    pub fn div_bc(&mut self, a: V, b: V, b_axes: &[i64]) -> V {
        self.binary_bc(Op::Div, "Div", a, b, [Vec::new(), b_axes.to_vec()])
    }
    /// `a + b` where `b` has size 1 along `b_axes` (same rank as `a`).
    pub fn add_bc(&mut self, a: V, b: V, b_axes: &[i64]) -> V {
        self.binary_bc(Op::Add, "Add", a, b, [Vec::new(), b_axes.to_vec()])
    }
    /// `x` rounded through IEEE half precision (f32 → f16 → f32), with a straight-through
    /// gradient (the rounding counts as the identity when differentiating).
    pub fn round_f16(&mut self, x: V) -> V {
        let r = self.rank(x);
        let h = self.raw("Cast", &[x], r, vec![attr_int("to", 10)]);
        let back = self.raw(
            "Cast",
            &[h],
            r,
            vec![attr_int("to", i64::from(self.elem.code()))],
        );
        self.record(Op::StraightThrough, &[x], back)
    }
    /// `x` `[N, width]` rounded through 8-bit blocks of 32 the way ggml's CPU backend quantises
    /// activations to Q8_0 / Q8_1 before a quantised matmul: per block `amax = max|x|`,
    /// `q = round_half_even(x · 127 / amax)` (0 when `amax = 0`), value `q · f16(amax / 127)`.
    /// Straight-through gradient.
    pub fn round_q8(&mut self, x: V, width: i64) -> V {
        self.round_q8_sums(x, width).0
    }

    /// [`Graph::round_q8`] and, per block, Q8_1's stored sum `s = f16(amax/127 · Σ q)`
    /// (`[N, width/32]`), which ggml multiplies with the block minimum of Q4_1 / Q5_1 weights.
    /// The sums' gradient is that of the plain block sums of `x`.
    pub fn round_q8_sums(&mut self, x: V, width: i64) -> (V, V) {
        assert!(width % 32 == 0, "Q8 rows of {width} are not blocks of 32");
        let nb = width / 32;
        let shape = self.i64_const(&[-1, nb, 32]);
        let xb = self.node("Reshape", &[self.name(x), shape], 3, vec![]);
        let ab = self.raw("Abs", &[xb], 3, vec![]);
        // opset 17: ReduceMax takes its axes as an attribute
        let amax = self.raw(
            "ReduceMax",
            &[ab],
            3,
            vec![attr_ints("axes", &[-1]), attr_int("keepdims", 1)],
        );
        let c127 = self.scalar(127.0);
        let d = self.raw("Div", &[amax, c127], 3, vec![]);
        let d16 = self.f16_trip(d, 3);
        let zero = self.scalar(0.0);
        let is0 = self.raw("Equal", &[amax, zero], 3, vec![]);
        let one = self.scalar(1.0);
        let safe = self.where_(is0, one, amax);
        let id = self.raw("Div", &[c127, safe], 3, vec![]);
        let id = self.where_(is0, zero, id);
        let xs = self.raw("Mul", &[xb, id], 3, vec![]);
        let q = self.raw("Round", &[xs], 3, vec![]);
        let v = self.raw("Mul", &[q, d16], 3, vec![]);
        let back = self.i64_const(&[-1, width]);
        let vn = self.name(v);
        let out = self.node("Reshape", &[vn, back], 2, vec![]);
        let xq = self.record(Op::StraightThrough, &[x], out);
        // s = f16(d · Σq) per block
        let axes = self.i64_const(&[-1]);
        let qn = self.name(q);
        let sq = self.node("ReduceSum", &[qn, axes], 3, vec![attr_int("keepdims", 1)]);
        let sd = self.raw("Mul", &[sq, d], 3, vec![]);
        let s16 = self.f16_trip(sd, 3);
        let flat = self.i64_const(&[-1, nb]);
        let sn = self.name(s16);
        let s_val = self.node("Reshape", &[sn, flat], 2, vec![]);
        // the differentiable block sums the rounded sums stand in for
        let xb_t = self.reshape(x, &[-1, nb, 32]);
        let bs = self.reduce_sum_last(xb_t);
        let bs = self.reshape(bs, &[-1, nb]);
        let s = self.record(Op::StraightThrough, &[bs], s_val);
        (xq, s)
    }

    /// Rounds the rows of `x` (`[N, width]`) through Q8_K, the activation type of ggml's k-quant
    /// weights (`quantize_row_q8_K_ref`): blocks of 256 values, one f32 scale from the block's
    /// largest-magnitude value `m` (the first one on ties), `q = round(−127 · x / m)` (half to
    /// even, as ggml's `nearest_int`), `x̂ = q · (1 / (−127 / m))`; an all-zero block stays zero.
    /// The gradient passes straight through.
    pub fn round_q8k(&mut self, x: V, width: i64) -> V {
        assert!(
            width % 256 == 0,
            "Q8_K rows of {width} are not blocks of 256"
        );
        let nb = width / 256;
        let shape = self.i64_const(&[-1, nb, 256]);
        let xb = self.node("Reshape", &[self.name(x), shape], 3, vec![]);
        let ab = self.raw("Abs", &[xb], 3, vec![]);
        let at = self.raw(
            "ArgMax",
            &[ab],
            3,
            vec![attr_int("axis", -1), attr_int("keepdims", 1)],
        );
        let m = self.raw("GatherElements", &[xb, at], 3, vec![attr_int("axis", -1)]);
        let zero = self.scalar(0.0);
        let one = self.scalar(1.0);
        let is0 = self.raw("Equal", &[m, zero], 3, vec![]);
        let safe = self.where_(is0, one, m);
        let cm127 = self.scalar(-127.0);
        let iscale = self.raw("Div", &[cm127, safe], 3, vec![]);
        let iscale = self.where_(is0, zero, iscale);
        let xs = self.raw("Mul", &[xb, iscale], 3, vec![]);
        let q = self.raw("Round", &[xs], 3, vec![]);
        let safe_is = self.where_(is0, one, iscale);
        let d = self.raw("Div", &[one, safe_is], 3, vec![]);
        let d = self.where_(is0, zero, d);
        let v = self.raw("Mul", &[q, d], 3, vec![]);
        let back = self.i64_const(&[-1, width]);
        let vn = self.name(v);
        let out = self.node("Reshape", &[vn, back], 2, vec![]);
        self.record(Op::StraightThrough, &[x], out)
    }

    /// RMSNorm of the rows of `x` (`[N, D]`) times `w` (`[D]`, constant): `x / √(mean(x²) + eps) · w`.
    pub fn rms_norm(&mut self, x: V, w: V, d: usize, eps: f64) -> V {
        let sq = self.mul(x, x);
        let s = self.reduce_sum_last(sq);
        let inv_d = self.scalar(1.0 / d as f64);
        let m = self.mul(s, inv_d);
        let e = self.scalar(eps);
        let m = self.add(m, e);
        let r = self.sqrt(m);
        let y = self.div_bc(x, r, &[-1]);
        self.mul(y, w)
    }

    /// ggml's CPU RMSNorm of the rows of `x` (`[N, D]`) times `w` (`[D]`, constant), computed
    /// as ggml does (squares summed in f64, `scale = 1/√(mean + eps)` in f32, `x · scale · w`),
    /// with the gradient of the plain f32 formula.
    pub fn rms_norm_ggml(&mut self, x: V, w: V, d: usize, eps: f64) -> V {
        let y = self.rms_norm(x, w, d, eps);
        let e = self.scalar(eps);
        // ggml's arithmetic
        let sqr = self.raw("Mul", &[x, x], 2, vec![]);
        let sq64 = self.raw("Cast", &[sqr], 2, vec![attr_int("to", 11)]);
        let axes = self.i64_const(&[-1]);
        let sqn = self.name(sq64);
        let sum = self.node("ReduceSum", &[sqn, axes], 2, vec![attr_int("keepdims", 1)]);
        let dd = self.value(0, false);
        let ddn = format!("c{}", dd.0);
        self.values[dd.0].name = ddn.clone();
        self.initializers.push(TensorProto {
            dims: vec![],
            data_type: 11,
            name: ddn,
            raw_data: (d as f64).to_le_bytes().to_vec(),
        });
        let mean = self.raw("Div", &[sum, dd], 2, vec![]);
        let mean = self.raw(
            "Cast",
            &[mean],
            2,
            vec![attr_int("to", i64::from(self.elem.code()))],
        );
        let mean = self.raw("Add", &[mean, e], 2, vec![]);
        let root = self.raw("Sqrt", &[mean], 2, vec![]);
        let scale = self.raw("Reciprocal", &[root], 2, vec![]);
        let yv = self.raw("Mul", &[x, scale], 2, vec![]);
        let yv = self.raw("Mul", &[yv, w], 2, vec![]);
        self.record(Op::StraightThrough, &[y], yv)
    }

    fn f16_trip(&mut self, x: V, rank: usize) -> V {
        let h = self.raw("Cast", &[x], rank, vec![attr_int("to", 10)]);
        self.raw(
            "Cast",
            &[h],
            rank,
            vec![attr_int("to", i64::from(self.elem.code()))],
        )
    }

    /// The LoRA term `scale · (x Aᵀ) Bᵀ` for `A [r, in]`, `B [out, r]` and a scalar `scale`.
    pub fn lora_term(&mut self, x: V, a: V, b: V, scale: V) -> V {
        let at = self.transpose(a);
        let u = self.matmul(x, at);
        let bt = self.transpose(b);
        let l = self.matmul(u, bt);
        self.mul(l, scale)
    }

    /// Matrix transpose.
    pub fn transpose(&mut self, a: V) -> V {
        self.unary(Op::Transpose, "Transpose", a, vec![])
    }
    /// `a + b`.
    pub fn add(&mut self, a: V, b: V) -> V {
        self.binary(Op::Add, "Add", a, b)
    }
    /// `a − b`.
    pub fn sub(&mut self, a: V, b: V) -> V {
        self.binary(Op::Sub, "Sub", a, b)
    }
    /// `a · b` element-wise.
    pub fn mul(&mut self, a: V, b: V) -> V {
        self.binary(Op::Mul, "Mul", a, b)
    }
    /// `min(a, b)` element-wise.
    pub fn min(&mut self, a: V, b: V) -> V {
        self.binary(Op::Min, "Min", a, b)
    }
    /// `max(a, b)` element-wise.
    pub fn max(&mut self, a: V, b: V) -> V {
        self.binary(Op::Max, "Max", a, b)
    }
    /// `e^a`.
    pub fn exp(&mut self, a: V) -> V {
        self.unary(Op::Exp, "Exp", a, vec![])
    }
    /// `ln a`.
    pub fn log(&mut self, a: V) -> V {
        self.unary(Op::Log, "Log", a, vec![])
    }
    /// `−a`.
    pub fn neg(&mut self, a: V) -> V {
        self.unary(Op::Neg, "Neg", a, vec![])
    }
    /// `σ(a)`.
    pub fn sigmoid(&mut self, a: V) -> V {
        self.unary(Op::Sigmoid, "Sigmoid", a, vec![])
    }
    /// Log-softmax over the last axis.
    pub fn log_softmax(&mut self, a: V) -> V {
        self.unary(Op::LogSoftmax, "LogSoftmax", a, vec![attr_int("axis", -1)])
    }
    /// `x[i, idx[i, j]]` (axis 1).
    pub fn gather_elements(&mut self, x: V, idx: V) -> V {
        let out = self.node(
            "GatherElements",
            &[self.name(x), self.name(idx)],
            2,
            vec![attr_int("axis", 1)],
        );
        self.record(Op::GatherElements, &[x, idx], out)
    }
    /// Sum of all elements (rank 0).
    pub fn reduce_sum_all(&mut self, x: V) -> V {
        let out = self.node(
            "ReduceSum",
            &[self.name(x)],
            0,
            vec![attr_int("keepdims", 0)],
        );
        self.record(Op::ReduceSumAll, &[x], out)
    }
    /// Sum over the last axis, kept as size 1.
    pub fn reduce_sum_last(&mut self, x: V) -> V {
        let axes = self.i64_const(&[-1]);
        let r = self.rank(x);
        let out = self.node(
            "ReduceSum",
            &[self.name(x), axes],
            r,
            vec![attr_int("keepdims", 1)],
        );
        self.record(Op::ReduceSumLast, &[x], out)
    }
    /// Reshape to `dims` (one may be −1).
    pub fn reshape(&mut self, x: V, dims: &[i64]) -> V {
        let shape = self.i64_const(dims);
        let out = self.node("Reshape", &[self.name(x), shape], dims.len(), vec![]);
        self.record(Op::Reshape, &[x], out)
    }
    /// The same value, with no gradient flowing through it.
    pub fn stop_gradient(&mut self, x: V) -> V {
        self.unary(Op::StopGradient, "Identity", x, vec![])
    }

    // ---- helpers used by the backward pass (not differentiated) -------------------------------

    fn raw(&mut self, ty: &str, inputs: &[V], rank: usize, attrs: Vec<AttributeProto>) -> V {
        let names: Vec<String> = inputs.iter().map(|v| self.name(*v)).collect();
        self.node(ty, &names, rank, attrs)
    }
    fn shape_of(&mut self, x: V) -> V {
        self.raw("Shape", &[x], 1, vec![])
    }
    fn zeros_like(&mut self, x: V) -> V {
        let s = self.shape_of(x);
        let r = self.rank(x);
        let t = TensorProto {
            dims: vec![1],
            data_type: self.elem.code(),
            name: String::new(),
            raw_data: self.elem.bytes(0.0),
        };
        self.raw(
            "ConstantOfShape",
            &[s],
            r,
            vec![AttributeProto {
                name: "value".into(),
                t: Some(t),
                r#type: 4,
                ..Default::default()
            }],
        )
    }
    fn where_(&mut self, c: V, a: V, b: V) -> V {
        let r = self.rank(a).max(self.rank(b));
        self.raw("Where", &[c, a, b], r, vec![])
    }
    /// Sums `g` down to the shape of `x`: over `axes` (kept) where `x` was broadcast along them;
    /// a scalar operand receives the sum of everything.
    fn unbroadcast_axes(&mut self, g: V, x: V, axes: &[i64]) -> V {
        if !axes.is_empty() {
            let ax = self.i64_const(axes);
            let gn = self.name(g);
            return self.node(
                "ReduceSum",
                &[gn, ax],
                self.rank(x),
                vec![attr_int("keepdims", 1)],
            );
        }
        self.unbroadcast(g, x)
    }

    /// Sums `g` down to the shape of `x` (a scalar operand receives the sum of everything).
    fn unbroadcast(&mut self, g: V, x: V) -> V {
        if self.rank(x) == 0 && self.rank(g) > 0 {
            self.raw("ReduceSum", &[g], 0, vec![attr_int("keepdims", 0)])
        } else {
            g
        }
    }
    fn accumulate(&mut self, adj: &mut HashMap<V, V>, x: V, g: V) {
        let g = match adj.get(&x) {
            Some(&prev) => self.raw("Add", &[prev, g], self.rank(x), vec![]),
            None => g,
        };
        adj.insert(x, g);
    }

    /// Reverse-mode differentiation: the gradients of the scalar `loss` with respect to `wrt`
    /// (trainable inputs). Inputs that do not reach the loss get zeros.
    pub fn grad(&mut self, loss: V, wrt: &[V]) -> Vec<V> {
        let mut adj: HashMap<V, V> = HashMap::new();
        let one = self.scalar(1.0);
        adj.insert(loss, one);
        let n = self.tape.len();
        for i in (0..n).rev() {
            let (op, inputs, out, bcast) = {
                let r = &self.tape[i];
                (r.op.clone(), r.inputs.clone(), r.output, r.bcast.clone())
            };
            let Some(&g) = adj.get(&out) else { continue };
            let needs: Vec<bool> = inputs.iter().map(|v| self.values[v.0].needs_grad).collect();
            if !needs.iter().any(|&b| b) {
                continue;
            }
            let r = self.rank(out);
            match op {
                Op::MatMul => {
                    let (a, b) = (inputs[0], inputs[1]);
                    let perm = vec![attr_ints("perm", &swap_last2(r))];
                    if needs[0] {
                        let bt = self.raw("Transpose", &[b], r, perm.clone());
                        let ga = self.raw("MatMul", &[g, bt], r, vec![]);
                        self.accumulate(&mut adj, a, ga);
                    }
                    if needs[1] {
                        let at = self.raw("Transpose", &[a], r, perm);
                        let gb = self.raw("MatMul", &[at, g], r, vec![]);
                        self.accumulate(&mut adj, b, gb);
                    }
                }
                Op::Permute(perm) => {
                    let mut inv = vec![0i64; perm.len()];
                    for (i, &p) in perm.iter().enumerate() {
                        inv[p as usize] = i as i64;
                    }
                    let ga = self.raw("Transpose", &[g], r, vec![attr_ints("perm", &inv)]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::Div => {
                    let (a, b) = (inputs[0], inputs[1]);
                    if needs[0] {
                        let t = self.raw("Div", &[g, b], r, vec![]);
                        let ga = self.unbroadcast_axes(t, a, &bcast[0]);
                        self.accumulate(&mut adj, a, ga);
                    }
                    if needs[1] {
                        // ∂(a/b)/∂b = −(a/b)/b
                        let t = self.raw("Mul", &[g, out], r, vec![]);
                        let t = self.raw("Div", &[t, b], r, vec![]);
                        let t = self.raw("Neg", &[t], r, vec![]);
                        let gb = self.unbroadcast_axes(t, b, &bcast[1]);
                        self.accumulate(&mut adj, b, gb);
                    }
                }
                Op::Sqrt => {
                    let half = self.scalar(0.5);
                    let t = self.raw("Div", &[g, out], r, vec![]);
                    let ga = self.raw("Mul", &[t, half], r, vec![]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::Softmax => {
                    // y ⊙ (g − Σ g ⊙ y)
                    let gy = self.raw("Mul", &[g, out], r, vec![]);
                    let axes = self.i64_const(&[-1]);
                    let gyn = self.name(gy);
                    let s = self.node("ReduceSum", &[gyn, axes], r, vec![attr_int("keepdims", 1)]);
                    let d = self.raw("Sub", &[g, s], r, vec![]);
                    let ga = self.raw("Mul", &[out, d], r, vec![]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::StraightThrough => {
                    self.accumulate(&mut adj, inputs[0], g);
                }
                Op::Transpose => {
                    let ga = self.raw("Transpose", &[g], 2, vec![]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::Add | Op::Sub => {
                    if needs[0] {
                        let ga = self.unbroadcast_axes(g, inputs[0], &bcast[0]);
                        self.accumulate(&mut adj, inputs[0], ga);
                    }
                    if needs[1] {
                        let gb = self.unbroadcast_axes(g, inputs[1], &bcast[1]);
                        let gb = if matches!(op, Op::Sub) {
                            self.raw("Neg", &[gb], self.rank(inputs[1]), vec![])
                        } else {
                            gb
                        };
                        self.accumulate(&mut adj, inputs[1], gb);
                    }
                }
                Op::Mul => {
                    let (a, b) = (inputs[0], inputs[1]);
                    if needs[0] {
                        let t = self.raw("Mul", &[g, b], r, vec![]);
                        let ga = self.unbroadcast_axes(t, a, &bcast[0]);
                        self.accumulate(&mut adj, a, ga);
                    }
                    if needs[1] {
                        let t = self.raw("Mul", &[g, a], r, vec![]);
                        let gb = self.unbroadcast_axes(t, b, &bcast[1]);
                        self.accumulate(&mut adj, b, gb);
                    }
                }
                Op::Exp => {
                    let ga = self.raw("Mul", &[g, out], r, vec![]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::Log => {
                    let ga = self.raw("Div", &[g, inputs[0]], r, vec![]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::Neg => {
                    let ga = self.raw("Neg", &[g], r, vec![]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::Sigmoid => {
                    // σ' = σ (1 − σ)
                    let one = self.scalar(1.0);
                    let om = self.raw("Sub", &[one, out], r, vec![]);
                    let d = self.raw("Mul", &[out, om], r, vec![]);
                    let ga = self.raw("Mul", &[g, d], r, vec![]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::Min | Op::Max => {
                    // ties go to the first operand
                    let (a, b) = (inputs[0], inputs[1]);
                    let mask = self.raw(
                        if matches!(op, Op::Min) {
                            "LessOrEqual"
                        } else {
                            "GreaterOrEqual"
                        },
                        &[a, b],
                        r,
                        vec![],
                    );
                    let zero = self.scalar(0.0);
                    if needs[0] {
                        let t = self.where_(mask, g, zero);
                        let ga = self.unbroadcast(t, a);
                        self.accumulate(&mut adj, a, ga);
                    }
                    if needs[1] {
                        let t = self.where_(mask, zero, g);
                        let gb = self.unbroadcast(t, b);
                        self.accumulate(&mut adj, b, gb);
                    }
                }
                Op::LogSoftmax => {
                    // g − softmax · Σ g
                    let axes = self.i64_const(&[-1]);
                    let gn = self.name(g);
                    let s = self.node("ReduceSum", &[gn, axes], r, vec![attr_int("keepdims", 1)]);
                    let p = self.raw("Exp", &[out], r, vec![]);
                    let ps = self.raw("Mul", &[p, s], r, vec![]);
                    let ga = self.raw("Sub", &[g, ps], r, vec![]);
                    self.accumulate(&mut adj, inputs[0], ga);
                }
                Op::GatherElements => {
                    let x = inputs[0];
                    let z = self.zeros_like(x);
                    let ga = self.raw(
                        "ScatterElements",
                        &[z, inputs[1], g],
                        self.rank(x),
                        vec![attr_int("axis", 1)],
                    );
                    self.accumulate(&mut adj, x, ga);
                }
                Op::ReduceSumAll | Op::ReduceSumLast => {
                    let x = inputs[0];
                    let s = self.shape_of(x);
                    let ga = self.raw("Expand", &[g, s], self.rank(x), vec![]);
                    self.accumulate(&mut adj, x, ga);
                }
                Op::Reshape => {
                    let x = inputs[0];
                    let s = self.shape_of(x);
                    let ga = self.raw("Reshape", &[g, s], self.rank(x), vec![]);
                    self.accumulate(&mut adj, x, ga);
                }
                Op::StopGradient => {}
            }
        }
        wrt.iter()
            .map(|&w| match adj.get(&w) {
                Some(&g) => g,
                None => self.zeros_like(w),
            })
            .collect()
    }

    /// The serialised `ModelProto` (opset 17).
    pub fn to_bytes(&self) -> Vec<u8> {
        let m = ModelProto {
            ir_version: 8,
            producer_name: "turnwise".into(),
            graph: Some(GraphProto {
                node: self.nodes.clone(),
                name: "turnwise_step".into(),
                initializer: self.initializers.clone(),
                input: self.inputs.clone(),
                output: self.outputs.clone(),
            }),
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: 17,
            }],
        };
        m.encode_to_vec()
    }
}

#[cfg(test)]
mod tests {
    //! Every vector-Jacobian rule against central finite differences, in f64, run by ONNX
    //! Runtime (the library is provisioned as in production).

    use super::*;
    use crate::graph::runtime::{session, Device};
    use crate::policy::sampler::Rng;
    use ndarray::{ArrayD, IxDyn};
    use ort::session::{Session, SessionInputValue};
    use ort::value::Tensor;

    fn rand(shape: &[usize], seed: u64, lo: f64, hi: f64) -> ArrayD<f64> {
        let mut r = Rng::new(seed);
        ArrayD::from_shape_fn(IxDyn(shape), |_| lo + (hi - lo) * r.next_f64())
    }

    fn run(sess: &mut Session, xs: &[ArrayD<f64>], w: &ArrayD<f64>) -> (f64, Vec<ArrayD<f64>>) {
        let mut feed: Vec<(String, SessionInputValue<'_>)> = xs
            .iter()
            .enumerate()
            .map(|(i, x)| {
                (
                    format!("x{i}"),
                    Tensor::from_array(x.clone()).unwrap().into(),
                )
            })
            .collect();
        feed.push((
            "weight".into(),
            Tensor::from_array(w.clone()).unwrap().into(),
        ));
        let out = sess.run(feed).unwrap();
        let loss = *out["loss"]
            .try_extract_array::<f64>()
            .unwrap()
            .iter()
            .next()
            .unwrap();
        let gs = (0..xs.len())
            .map(|i| {
                out[format!("g{i}").as_str()]
                    .try_extract_array::<f64>()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        (loss, gs)
    }

    /// Builds `loss = Σ weight ⊙ f(x, …)` (random weights, so every output element matters) and
    /// checks `∂loss/∂x` against central finite differences.
    fn check(
        name: &str,
        shapes: &[&[usize]],
        out: &[usize],
        f: impl Fn(&mut Graph, &[V]) -> V,
        range: (f64, f64),
    ) {
        let mut g = Graph::new(Elem::F64);
        let xs: Vec<V> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                g.input(
                    &format!("x{i}"),
                    &s.iter().map(|&d| Dim::Fixed(d as i64)).collect::<Vec<_>>(),
                    true,
                )
            })
            .collect();
        let y = f(&mut g, &xs);
        let wv = g.input(
            "weight",
            &out.iter()
                .map(|&d| Dim::Fixed(d as i64))
                .collect::<Vec<_>>(),
            false,
        );
        let p = g.mul(y, wv);
        let loss = g.reduce_sum_all(p);
        let grads = g.grad(loss, &xs);
        g.output(loss, "loss");
        for (i, gr) in grads.iter().enumerate() {
            g.output(*gr, &format!("g{i}"));
        }
        let (mut sess, _) = session(&g.to_bytes(), Device::Cpu, 1).expect("session");
        let inputs: Vec<ArrayD<f64>> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| rand(s, 11 + i as u64, range.0, range.1))
            .collect();
        let weight = rand(out, 99, -1.0, 1.0);
        let (_, grads) = run(&mut sess, &inputs, &weight);
        let eps = 1e-6;
        for (i, x) in inputs.iter().enumerate() {
            for flat in 0..x.len() {
                let mut xp = inputs.clone();
                let mut xm = inputs.clone();
                xp[i].as_slice_mut().unwrap()[flat] += eps;
                xm[i].as_slice_mut().unwrap()[flat] -= eps;
                let fd =
                    (run(&mut sess, &xp, &weight).0 - run(&mut sess, &xm, &weight).0) / (2.0 * eps);
                let an = grads[i].as_slice().unwrap()[flat];
                assert!(
                    (fd - an).abs() < 1e-6 * (1.0 + fd.abs()),
                    "{name}: input {i} element {flat}: finite difference {fd} vs rule {an}"
                );
            }
        }
    }

    #[test]
    fn vjp_rules_match_finite_differences() {
        let m = &[3usize, 4][..];
        check(
            "matmul",
            &[&[3, 4], &[4, 2]],
            &[3, 2],
            |g, x| g.matmul(x[0], x[1]),
            (-1.0, 1.0),
        );
        check(
            "transpose",
            &[m],
            &[4, 3],
            |g, x| g.transpose(x[0]),
            (-1.0, 1.0),
        );
        check("add", &[m, m], m, |g, x| g.add(x[0], x[1]), (-1.0, 1.0));
        check(
            "add scalar",
            &[m, &[]],
            m,
            |g, x| g.add(x[0], x[1]),
            (-1.0, 1.0),
        );
        check("sub", &[m, m], m, |g, x| g.sub(x[0], x[1]), (-1.0, 1.0));
        check(
            "sub scalar",
            &[&[], m],
            m,
            |g, x| g.sub(x[0], x[1]),
            (-1.0, 1.0),
        );
        check("mul", &[m, m], m, |g, x| g.mul(x[0], x[1]), (-1.0, 1.0));
        check(
            "mul scalar",
            &[m, &[]],
            m,
            |g, x| g.mul(x[0], x[1]),
            (-1.0, 1.0),
        );
        check("exp", &[m], m, |g, x| g.exp(x[0]), (-1.0, 1.0));
        check("log", &[m], m, |g, x| g.log(x[0]), (0.5, 2.0));
        check("neg", &[m], m, |g, x| g.neg(x[0]), (-1.0, 1.0));
        check("sigmoid", &[m], m, |g, x| g.sigmoid(x[0]), (-3.0, 3.0));
        check("min", &[m, m], m, |g, x| g.min(x[0], x[1]), (-1.0, 1.0));
        check("max", &[m, m], m, |g, x| g.max(x[0], x[1]), (-1.0, 1.0));
        check(
            "min scalar",
            &[m, &[]],
            m,
            |g, x| g.min(x[0], x[1]),
            (-1.0, 1.0),
        );
        check(
            "log_softmax",
            &[m],
            m,
            |g, x| g.log_softmax(x[0]),
            (-2.0, 2.0),
        );
        check(
            "reduce_sum_all",
            &[m],
            &[],
            |g, x| g.reduce_sum_all(x[0]),
            (-1.0, 1.0),
        );
        check(
            "reduce_sum_last",
            &[m],
            &[3, 1],
            |g, x| g.reduce_sum_last(x[0]),
            (-1.0, 1.0),
        );
        check(
            "reshape",
            &[m],
            &[12],
            |g, x| g.reshape(x[0], &[-1]),
            (-1.0, 1.0),
        );
        check(
            "gather_elements",
            &[m],
            &[3, 1],
            |g, x| {
                let idx = g.const_i64(&[2, 0, 3], &[3, 1]);
                g.gather_elements(x[0], idx)
            },
            (-1.0, 1.0),
        );
    }

    #[test]
    fn vjp_rules_of_the_block_ops_match_finite_differences() {
        let m = &[3usize, 4][..];
        check(
            "batched matmul",
            &[&[2, 3, 4], &[2, 4, 5]],
            &[2, 3, 5],
            |g, x| g.matmul(x[0], x[1]),
            (-1.0, 1.0),
        );
        check(
            "permute",
            &[&[2, 3, 4]],
            &[3, 4, 2],
            |g, x| g.permute(x[0], &[1, 2, 0]),
            (-1.0, 1.0),
        );
        check("div", &[m, m], m, |g, x| g.div(x[0], x[1]), (0.5, 2.0));
        check(
            "div scalar",
            &[m, &[]],
            m,
            |g, x| g.div(x[0], x[1]),
            (0.5, 2.0),
        );
        check("sqrt", &[m], m, |g, x| g.sqrt(x[0]), (0.5, 2.0));
        check("softmax", &[m], m, |g, x| g.softmax(x[0]), (-2.0, 2.0));
        check(
            "softmax rank 3",
            &[&[2, 3, 4]],
            &[2, 3, 4],
            |g, x| g.softmax(x[0]),
            (-2.0, 2.0),
        );
        check(
            "mul_bc",
            &[m, &[3, 1]],
            m,
            |g, x| g.mul_bc(x[0], x[1], &[-1]),
            (-1.0, 1.0),
        );
        check(
            "div_bc",
            &[m, &[1, 4]],
            m,
            |g, x| g.div_bc(x[0], x[1], &[0]),
            (0.5, 2.0),
        );
        check(
            "add_bc",
            &[&[2, 3, 4], &[2, 1, 4]],
            &[2, 3, 4],
            |g, x| g.add_bc(x[0], x[1], &[1]),
            (-1.0, 1.0),
        );
    }

    /// Runs a one-input f32 graph `y = f(x)`, `loss = Σ w ⊙ y`, returning `y` and `∂loss/∂x`.
    fn run_f32(
        x: &ndarray::Array2<f32>,
        w: &ndarray::Array2<f32>,
        f: impl Fn(&mut Graph, V) -> V,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut g = Graph::new(Elem::F32);
        let (n, d) = x.dim();
        let xv = g.input("x", &[Dim::Fixed(n as i64), Dim::Fixed(d as i64)], true);
        let wv = g.input("w", &[Dim::Fixed(n as i64), Dim::Fixed(d as i64)], false);
        let y = f(&mut g, xv);
        let p = g.mul(y, wv);
        let l = g.reduce_sum_all(p);
        let gr = g.grad(l, &[xv]);
        g.output(y, "y");
        g.output(gr[0], "gx");
        let (mut sess, _) = session(&g.to_bytes(), Device::Cpu, 1).unwrap();
        let out = sess
            .run(vec![
                ("x", Tensor::from_array(x.clone()).unwrap()),
                ("w", Tensor::from_array(w.clone()).unwrap()),
            ])
            .unwrap();
        let get = |k: &str| -> Vec<f32> {
            out[k]
                .try_extract_array::<f32>()
                .unwrap()
                .iter()
                .copied()
                .collect()
        };
        (get("y"), get("gx"))
    }

    #[test]
    fn straight_through_rounding_matches_ggml_and_passes_the_gradient() {
        use crate::policy::llama;
        let mut r = Rng::new(5);
        let x = ndarray::Array2::from_shape_fn((3, 64), |(i, j)| {
            if i == 2 && j < 32 {
                0.0 // an all-zero block quantises to zeros
            } else {
                ((r.next_f64() * 2.0 - 1.0) * 3.0) as f32
            }
        });
        let w = ndarray::Array2::from_shape_fn((3, 64), |(i, j)| (i * 64 + j) as f32 * 0.01);
        let (y, gx) = run_f32(&x, &w, |g, v| g.round_q8(v, 64));
        for (ty, name) in [
            (llama_cpp_sys_2::GGML_TYPE_Q8_1, "Q8_1"),
            (llama_cpp_sys_2::GGML_TYPE_Q8_0, "Q8_0"),
        ] {
            for i in 0..3 {
                let row: Vec<f32> = x.row(i).to_vec();
                let want = llama::round_through(ty, &row).unwrap();
                assert_eq!(&y[i * 64..(i + 1) * 64], &want[..], "{name} row {i}");
            }
        }
        assert_eq!(gx, w.iter().copied().collect::<Vec<_>>());
        // Q8_K (k-quant weights): blocks of 256, the scale from the signed largest value
        let x256 = ndarray::Array2::from_shape_fn((3, 256), |(i, j)| {
            if i == 2 {
                0.0
            } else {
                ((r.next_f64() * 2.0 - 1.0) * (1.0 + j as f64 / 64.0)) as f32
            }
        });
        let w256 = ndarray::Array2::from_shape_fn((3, 256), |(i, j)| (i * 256 + j) as f32 * 0.01);
        let (y, gx) = run_f32(&x256, &w256, |g, v| g.round_q8k(v, 256));
        for i in 0..3 {
            let row: Vec<f32> = x256.row(i).to_vec();
            let want = llama::round_through(llama_cpp_sys_2::GGML_TYPE_Q8_K, &row).unwrap();
            assert_eq!(&y[i * 256..(i + 1) * 256], &want[..], "Q8_K row {i}");
        }
        assert_eq!(gx, w256.iter().copied().collect::<Vec<_>>());
        let (y, gx) = run_f32(&x, &w, |g, v| g.round_f16(v));
        let want: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        assert_eq!(y, want);
        assert_eq!(gx, w.iter().copied().collect::<Vec<_>>());
    }

    #[test]
    fn stop_gradient_blocks_and_unused_inputs_get_zeros() {
        let mut g = Graph::new(Elem::F64);
        let x = g.input("x", &[Dim::Fixed(2)], true);
        let y = g.input("y", &[Dim::Fixed(2)], true);
        let s = g.stop_gradient(x);
        let p = g.mul(s, x); // d/dx = sg(x) = x, not 2x
        let l = g.reduce_sum_all(p);
        let gr = g.grad(l, &[x, y]);
        g.output(gr[0], "gx");
        g.output(gr[1], "gy");
        let (mut sess, _) = session(&g.to_bytes(), Device::Cpu, 1).unwrap();
        let xv = ndarray::arr1(&[1.5f64, -2.0]);
        let feed = vec![
            ("x", Tensor::from_array(xv.clone()).unwrap()),
            ("y", Tensor::from_array(xv).unwrap()),
        ];
        let out = sess.run(feed).unwrap();
        let gx: Vec<f64> = out["gx"]
            .try_extract_array::<f64>()
            .unwrap()
            .iter()
            .copied()
            .collect();
        let gy: Vec<f64> = out["gy"]
            .try_extract_array::<f64>()
            .unwrap()
            .iter()
            .copied()
            .collect();
        assert_eq!(gx, vec![1.5, -2.0]);
        assert_eq!(gy, vec![0.0, 0.0]);
    }
}
