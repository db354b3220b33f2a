"""Bad input: the right TapegradError subclass, a message naming op and argument, no change.

Each row calls one op wrongly on a tape of prepared leaves. It must raise the named subclass
of `tg.TapegradError` (never a bare Python error), with a message that holds the op's name and
the offending argument and the caller's line, and the tape must keep its length and its very
nodes. A second table lists the edge inputs that must *work* (zero-size dims where numpy
works, rank-0 values, NaN outside anomaly mode).
"""

# This file passes wrong argument types on purpose.
# pyright: reportArgumentType=false

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest

import tapegrad as tg
from tapegrad._tape import deferring

Array = np.ndarray[Any, Any]


class Env:
    """A tape holding one leaf of each kind the rows need, plus ids that are not on it."""

    def __init__(self) -> None:
        self.tape = tg.Tape()
        self.f32 = self.add(np.ones((2, 3), np.float32), grad=True)
        self.f64 = self.add(np.ones((2, 3), np.float64), grad=True)
        self.i64 = self.add(np.ones((2, 3), np.int64))
        self.labels = self.add(np.array([0, 2], np.int64))
        self.flabels = self.add(np.array([0.0, 2.0], np.float32))
        self.mask = self.add(np.ones((2, 3), np.bool_))
        self.s32 = self.add(np.float32(2.0), grad=True)
        self.w32 = self.add(np.ones((3, 4), np.float32))
        self.w64 = self.add(np.ones((3, 4), np.float64))
        self.m43 = self.add(np.ones((4, 3), np.float32))
        self.img = self.add(np.ones((1, 2, 5, 5), np.float32))
        self.k3 = self.add(np.ones((4, 3, 3, 3), np.float32))  # wrong in-channels for img
        self.k7 = self.add(np.ones((1, 2, 7, 7), np.float32))
        self.k2 = self.add(np.ones((1, 2, 3, 3), np.float32))
        self.b3 = self.add(np.ones(3, np.float32))
        self.a3 = self.add(np.ones((2, 3, 4), np.float32))
        self.b3x = self.add(np.ones((3, 4, 5), np.float32))
        self.zero_rows = self.add(np.ones((0, 3), np.float32))
        # Their sum would be 2**36 floats (256 GiB): more than any device allocates at once.
        self.tape, self.tall = tg.broadcast_to(self.tape, self.s32, (2**18, 1))
        self.tape, self.wide = tg.broadcast_to(self.tape, self.s32, (1, 2**18))
        # Branches: two ops on the same tape; their ids belong to sibling tapes.
        self.branch_a, self.a_id = tg.exp(self.tape, self.f32)
        self.branch_b, self.b_id = tg.log(self.tape, self.f32)
        _, self.foreign = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
        _, self.foreign_indices = tg.leaf(tg.Tape(), np.array([0, 1]))
        self.last = self.add(np.zeros(1, np.float32))  # self.tape is the store's end again
        longer = tg.Tape()
        for _ in range(len(self.tape) + 2):
            longer, self.beyond = tg.leaf(longer, np.ones((2, 3), np.float32))

    def add(self, data: Array | np.generic, grad: bool = False) -> tg.Id:
        self.tape, i = tg.leaf(self.tape, data, requires_grad=grad)
        return i


@dataclass(frozen=True)
class Bad:
    name: str
    call: Callable[[Env], Any]
    error: type[tg.TapegradError]
    words: tuple[str, ...]  # each must appear in the message (op, argument, hint)


BAD: list[Bad] = [
    # float32 mixed with float64: DTypeError pointing at astype.
    Bad("add_f32_f64", lambda e: tg.add(e.tape, e.f32, e.f64), tg.DTypeError,
        ("add", "float32", "float64", "astype")),
    Bad("maximum_f32_f64", lambda e: tg.maximum(e.tape, e.f64, e.f32), tg.DTypeError,
        ("maximum", "astype")),
    Bad("matmul_f32_f64", lambda e: tg.matmul(e.tape, e.f32, e.w64), tg.DTypeError,
        ("matmul", "astype")),
    Bad("linear_f32_f64", lambda e: tg.linear(e.tape, e.f32, e.w64), tg.DTypeError,
        ("linear", "w", "astype")),
    Bad("concat_f32_f64", lambda e: tg.concat(e.tape, [e.f32, e.f64]), tg.DTypeError,
        ("concat", "astype")),
    Bad("where_f32_f64", lambda e: tg.where(e.tape, e.mask, e.f32, e.f64), tg.DTypeError,
        ("where", "astype")),
    Bad("mse_f32_f64", lambda e: tg.mse(e.tape, e.f32, e.f64), tg.DTypeError, ("mse", "astype")),
    # Integer operands to float ops.
    Bad("exp_int", lambda e: tg.exp(e.tape, e.i64), tg.DTypeError, ("exp", "'x'", "int64")),
    Bad("add_int", lambda e: tg.add(e.tape, e.i64, 1.0), tg.DTypeError, ("add", "'a'", "int64")),
    Bad("mean_int", lambda e: tg.mean(e.tape, e.i64), tg.DTypeError, ("int64",)),
    Bad("var_int", lambda e: tg.var(e.tape, e.i64), tg.DTypeError, ("var", "int64")),
    Bad("softmax_int", lambda e: tg.softmax(e.tape, e.i64), tg.DTypeError, ("softmax", "int64")),
    Bad("matmul_int", lambda e: tg.matmul(e.tape, e.i64, e.w32), tg.DTypeError,
        ("matmul", "'a'", "int64")),
    Bad("relu_bool", lambda e: tg.relu(e.tape, e.mask), tg.DTypeError, ("relu", "bool")),
    Bad("cross_entropy_float_labels", lambda e: tg.cross_entropy(e.tape, e.f32, e.flabels),
        tg.DTypeError, ("cross_entropy", "labels", "int32 or int64")),
    Bad("take_float_indices", lambda e: tg.take(e.tape, e.f32, e.flabels), tg.DTypeError,
        ("take", "indices", "int32 or int64")),
    Bad("where_float_cond", lambda e: tg.where(e.tape, e.f32, e.f32, 0.0), tg.DTypeError,
        ("where", "cond")),
    Bad("layer_norm_int", lambda e: tg.layer_norm(e.tape, e.i64), tg.DTypeError,
        ("layer_norm", "x")),
    # Wrong matmul and conv shapes.
    Bad("matmul_inner", lambda e: tg.matmul(e.tape, e.f32, e.f32), tg.ShapeError,
        ("matmul", "(2, 3)", "a's last axis")),
    Bad("matmul_rank0", lambda e: tg.matmul(e.tape, e.s32, e.f32), tg.ShapeError,
        ("matmul", "'a'", "scalar")),
    Bad("matmul_batch", lambda e: tg.matmul(e.tape, e.a3, e.b3x), tg.ShapeError,
        ("matmul", "batch")),
    Bad("linear_in", lambda e: tg.linear(e.tape, e.f32, e.m43), tg.ShapeError,
        ("linear", "w", "3", "4")),
    Bad("conv_channels", lambda e: tg.conv2d(e.tape, e.img, e.k3), tg.ShapeError,
        ("conv2d", "channels", "w")),
    Bad("conv_2d_input", lambda e: tg.conv2d(e.tape, e.f32, e.k2), tg.ShapeError,
        ("conv2d", "x", "(2, 3)")),
    Bad("conv_kernel_too_big", lambda e: tg.conv2d(e.tape, e.img, e.k7), tg.ShapeError,
        ("conv2d", "kernel", "(7, 7)")),
    Bad("conv_bias_shape", lambda e: tg.conv2d(e.tape, e.img, e.k2, e.b3), tg.ShapeError,
        ("conv2d", "b", "(1,)")),
    Bad("conv_stride_0", lambda e: tg.conv2d(e.tape, e.img, e.k2, stride=0), tg.ShapeError,
        ("conv2d", "stride")),
    Bad("conv_padding_negative", lambda e: tg.conv2d(e.tape, e.img, e.k2, padding=-1),
        tg.ShapeError, ("conv2d", "padding")),
    Bad("conv_stride_triple", lambda e: tg.conv2d(e.tape, e.img, e.k2, stride=(1, 1, 1)),
        tg.ShapeError, ("conv2d", "stride", "pair")),
    Bad("max_pool_kernel_big", lambda e: tg.max_pool2d(e.tape, e.img, 7), tg.ShapeError,
        ("max_pool2d", "kernel")),
    Bad("avg_pool_padding_big", lambda e: tg.avg_pool2d(e.tape, e.img, 2, padding=2),
        tg.ShapeError, ("avg_pool2d", "padding")),
    Bad("max_pool_2d_input", lambda e: tg.max_pool2d(e.tape, e.f32, 2), tg.ShapeError,
        ("max_pool2d", "x")),
    Bad("broadcast", lambda e: tg.add(e.tape, e.f32, e.m43), tg.ShapeError,
        ("add", "a (2, 3)", "b (4, 3)", "axis -2")),
    Bad("mse_shapes", lambda e: tg.mse(e.tape, e.f32, e.m43), tg.ShapeError,
        ("mse", "a", "b", "(4, 3)")),
    Bad("cross_entropy_labels_shape", lambda e: tg.cross_entropy(e.tape, e.m43, e.labels),
        tg.ShapeError, ("cross_entropy", "labels", "(4,)")),
    Bad("cross_entropy_logits_rank", lambda e: tg.cross_entropy(e.tape, e.img, e.labels),
        tg.ShapeError, ("cross_entropy", "logits")),
    Bad("layer_norm_weight", lambda e: tg.layer_norm(e.tape, e.f32, weight=e.w32), tg.ShapeError,
        ("layer_norm", "weight", "(3,)")),
    Bad("batch_norm_bias", lambda e: tg.batch_norm(e.tape, e.f32, bias=e.w32), tg.ShapeError,
        ("batch_norm", "bias", "(3,)")),
    # Bad axes.
    Bad("sum_axis", lambda e: tg.sum(e.tape, e.f32, axis=2), tg.ShapeError,
        ("sum", "axis 2", "rank 2")),
    Bad("max_axis_negative", lambda e: tg.max(e.tape, e.f32, axis=-3), tg.ShapeError,
        ("max", "axis -3")),
    Bad("mean_axis_repeat", lambda e: tg.mean(e.tape, e.f32, axis=(0, -2)), tg.ShapeError,
        ("mean", "repeats")),
    Bad("sum_axis_float", lambda e: tg.sum(e.tape, e.f32, axis=1.0), tg.ShapeError,
        ("sum", "axis", "1.0")),
    Bad("var_axis_tuple", lambda e: tg.var(e.tape, e.f32, axis=(0, 5)), tg.ShapeError,
        ("var", "axis 5")),
    Bad("logsumexp_axis", lambda e: tg.logsumexp(e.tape, e.f32, axis=2), tg.ShapeError,
        ("logsumexp", "axis 2")),
    Bad("softmax_axis", lambda e: tg.softmax(e.tape, e.f32, axis=5), tg.ShapeError,
        ("softmax", "axis 5")),
    Bad("log_softmax_axis_none", lambda e: tg.log_softmax(e.tape, e.f32, axis=None),
        tg.ShapeError, ("log_softmax", "axis")),
    Bad("concat_axis", lambda e: tg.concat(e.tape, [e.f32, e.f32], axis=2), tg.ShapeError,
        ("concat", "axis 2")),
    Bad("stack_axis", lambda e: tg.stack(e.tape, [e.f32, e.f32], axis=-4), tg.ShapeError,
        ("stack", "axis -4")),
    Bad("expand_dims_axis", lambda e: tg.expand_dims(e.tape, e.f32, 3), tg.ShapeError,
        ("expand_dims", "axis 3")),
    Bad("squeeze_not_one", lambda e: tg.squeeze(e.tape, e.f32, axis=0), tg.ShapeError,
        ("squeeze", "axis 0", "size 2")),
    Bad("transpose_not_permutation", lambda e: tg.transpose(e.tape, e.f32, (0, 0)),
        tg.ShapeError, ("transpose", "axes", "permutation")),
    Bad("transpose_axes_short", lambda e: tg.transpose(e.tape, e.f32, axes=(0,)), tg.ShapeError,
        ("transpose", "axes")),
    Bad("transpose_axes_float", lambda e: tg.transpose(e.tape, e.f32, (1.0, 0.0)),
        tg.ShapeError, ("transpose", "axis")),
    Bad("take_axis", lambda e: tg.take(e.tape, e.f32, e.labels, axis=2), tg.ShapeError,
        ("take", "axis 2")),
    # Reshapes and other shape arguments.
    Bad("reshape_size", lambda e: tg.reshape(e.tape, e.f32, (4, 2)), tg.ShapeError,
        ("reshape", "(2, 3)", "(4, 2)")),
    Bad("reshape_minus1", lambda e: tg.reshape(e.tape, e.f32, (4, -1)), tg.ShapeError,
        ("reshape", "(4, -1)")),
    Bad("reshape_two_minus1", lambda e: tg.reshape(e.tape, e.f32, (-1, -1)), tg.ShapeError,
        ("reshape", "-1")),
    Bad("reshape_float", lambda e: tg.reshape(e.tape, e.f32, (3.0, 2)), tg.ShapeError,
        ("reshape", "shape")),
    Bad("reshape_none", lambda e: tg.reshape(e.tape, e.f32, None), tg.ShapeError,
        ("reshape", "shape")),
    Bad("broadcast_to", lambda e: tg.broadcast_to(e.tape, e.f32, (3, 3)), tg.ShapeError,
        ("broadcast_to", "(2, 3)", "(3, 3)")),
    Bad("broadcast_to_negative", lambda e: tg.broadcast_to(e.tape, e.f32, (-1, 3)),
        tg.ShapeError, ("broadcast_to",)),
    Bad("pad_pairs", lambda e: tg.pad(e.tape, e.f32, ((1, 1), (1, 1), (1, 1))), tg.ShapeError,
        ("pad", "pad_width")),
    Bad("pad_negative", lambda e: tg.pad(e.tape, e.f32, -1), tg.ShapeError,
        ("pad", "pad_width", "negative")),
    Bad("slice_too_many", lambda e: tg.slice(e.tape, e.f32, np.s_[0, 0, 0]), tg.ShapeError,
        ("slice", "too many")),
    Bad("slice_out_of_bounds", lambda e: tg.slice(e.tape, e.f32, np.s_[:, 3]), tg.ShapeError,
        ("slice", "index 3", "axis 1")),
    Bad("slice_step_zero", lambda e: tg.slice(e.tape, e.f32, np.s_[::0]), tg.ShapeError,
        ("slice", "step")),
    Bad("slice_array", lambda e: tg.slice(e.tape, e.f32, np.array([0, 1])), tg.DTypeError,
        ("slice", "take")),
    Bad("slice_float", lambda e: tg.slice(e.tape, e.f32, 1.5), tg.DTypeError, ("slice", "1.5")),
    Bad("concat_shapes", lambda e: tg.concat(e.tape, [e.f32, e.m43], axis=1), tg.ShapeError,
        ("concat", "operand 1", "(4, 3)")),
    Bad("concat_empty", lambda e: tg.concat(e.tape, []), tg.ShapeError, ("concat", "empty")),
    Bad("concat_not_list", lambda e: tg.concat(e.tape, e.f32), tg.DTypeError,
        ("concat", "list")),
    Bad("stack_shapes", lambda e: tg.stack(e.tape, [e.f32, e.m43]), tg.ShapeError,
        ("stack", "operand 1")),
    Bad("dropout_p", lambda e: tg.dropout(e.tape, e.f32, 1.5, 0), tg.ShapeError,
        ("dropout", "p", "1.5")),
    Bad("dropout_seed", lambda e: tg.dropout(e.tape, e.f32, 0.5, 1.5), tg.DTypeError,
        ("dropout", "seed")),
    Bad("layer_norm_eps", lambda e: tg.layer_norm(e.tape, e.f32, eps=-1.0), tg.ShapeError,
        ("layer_norm", "eps")),
    Bad("gelu_approximate", lambda e: tg.gelu(e.tape, e.f32, approximate="fast"), tg.ShapeError,
        ("gelu", "approximate", "'fast'")),
    Bad("astype_complex", lambda e: tg.astype(e.tape, e.f32, np.complex64), tg.DTypeError,
        ("astype", "complex64")),
    Bad("max_empty_axis", lambda e: tg.max(e.tape, e.zero_rows, axis=0), tg.ShapeError,
        ("max", "empty")),
    # Rank-0 values where an axis is needed.
    Bad("softmax_rank0", lambda e: tg.softmax(e.tape, e.s32), tg.ShapeError,
        ("softmax", "rank 0")),
    Bad("concat_rank0", lambda e: tg.concat(e.tape, [e.s32, e.s32]), tg.ShapeError,
        ("concat", "stack")),
    Bad("layer_norm_rank0", lambda e: tg.layer_norm(e.tape, e.s32), tg.ShapeError,
        ("layer_norm", "x")),
    Bad("slice_rank0", lambda e: tg.slice(e.tape, e.s32, np.s_[0]), tg.ShapeError,
        ("slice", "shape ()")),
    Bad("take_rank0", lambda e: tg.take(e.tape, e.s32, e.labels), tg.ShapeError,
        ("take", "rank 0")),
    # Python lists and arrays where an id goes.
    Bad("leaf_list", lambda e: tg.leaf(e.tape, [1.0, 2.0]), tg.DTypeError,
        ("leaf", "data", "np.asarray")),
    Bad("leaf_str", lambda e: tg.leaf(e.tape, "abc"), tg.DTypeError, ("leaf", "data", "str")),
    Bad("leaf_float16", lambda e: tg.leaf(e.tape, np.ones(2, np.float16)), tg.DTypeError,
        ("leaf", "float16")),
    Bad("add_list", lambda e: tg.add(e.tape, e.f32, [1.0, 2.0, 3.0]), tg.DTypeError,
        ("add", "'b'", "list", "tg.leaf")),
    Bad("mul_array", lambda e: tg.mul(e.tape, np.ones(3), e.f32), tg.DTypeError,
        ("mul", "'a'", "ndarray")),
    Bad("exp_list", lambda e: tg.exp(e.tape, [1.0]), tg.DTypeError, ("exp", "'x'", "list")),
    Bad("add_two_numbers", lambda e: tg.add(e.tape, 1.0, 2.0), tg.DTypeError, ("add", "Id")),
    Bad("take_list", lambda e: tg.take(e.tape, e.f32, [0, 1]), tg.DTypeError,
        ("take", "indices", "list")),
    Bad("backward_seed_list", lambda e: tg.backward(e.tape, e.f32, seed=[[1.0] * 3] * 2),
        tg.DTypeError, ("backward", "seed", "list")),
    # Ids from another tape or a sibling branch.
    Bad("foreign_add", lambda e: tg.add(e.tape, e.f32, e.foreign), tg.TapeError,
        ("add", "'b'", "another tape")),
    Bad("foreign_exp", lambda e: tg.exp(e.tape, e.foreign), tg.TapeError, ("exp", "'x'")),
    Bad("foreign_matmul", lambda e: tg.matmul(e.tape, e.foreign, e.w32), tg.TapeError,
        ("matmul", "'a'")),
    Bad("foreign_concat", lambda e: tg.concat(e.tape, [e.f32, e.foreign]), tg.TapeError,
        ("concat", "operand 1")),
    Bad("foreign_value", lambda e: tg.value(e.tape, e.foreign), tg.TapeError, ("value", "id")),
    Bad("sibling_add", lambda e: tg.add(e.branch_a, e.a_id, e.b_id), tg.TapeError,
        ("add", "'b'", "sibling")),
    Bad("sibling_backward", lambda e: tg.backward(e.branch_a, e.b_id, seed=np.ones(
        (2, 3), np.float32)), tg.TapeError, ("backward", "loss")),
    Bad("sibling_wrt", lambda e: tg.backward(e.branch_a, e.s32, wrt=[e.b_id]), tg.TapeError,
        ("backward", "wrt[0]")),
    Bad("foreign_wrt", lambda e: tg.backward(e.tape, e.s32, wrt=e.foreign), tg.TapeError,
        ("backward", "wrt[0]")),
    Bad("foreign_take_indices", lambda e: tg.take(e.tape, e.f32, e.foreign_indices),
        tg.TapeError, ("take", "indices")),
    # The loss and the seed.
    Bad("loss_beyond_tape", lambda e: tg.backward(e.tape, e.beyond, seed=np.ones(
        (2, 3), np.float32)), tg.TapeError, ("backward", "loss", "beyond")),
    Bad("loss_beyond_on_tape", lambda e: tg.backward_on_tape(e.tape, e.beyond, [e.f32]),
        tg.TapeError, ("backward_on_tape", "loss")),
    Bad("loss_of_sibling", lambda e: tg.backward(e.tape, e.a_id, seed=np.ones(
        (2, 3), np.float32)), tg.TapeError, ("backward", "loss", "sibling")),
    Bad("seed_shape", lambda e: tg.backward(e.tape, e.f32, seed=np.ones((3, 2), np.float32)),
        tg.ShapeError, ("backward", "seed", "(3, 2)", "(2, 3)")),
    Bad("seed_dtype_int", lambda e: tg.backward(e.tape, e.f32, seed=np.ones((2, 3), np.int64)),
        tg.DTypeError, ("backward", "seed", "int64")),
    Bad("seed_id_dtype_on_tape", lambda e: tg.backward_on_tape(e.tape, e.f32, [e.f32],
                                                               seed=e.f64),
        tg.DTypeError, ("backward_on_tape", "seed", "float64", "astype")),
    Bad("seed_scalar_for_vector", lambda e: tg.backward(e.tape, e.f32, seed=1.0),
        tg.ShapeError, ("backward", "seed")),
    Bad("non_scalar_loss", lambda e: tg.backward(e.tape, e.f32), tg.ShapeError,
        ("backward", "loss", "(2, 3)", "seed")),
    Bad("non_scalar_loss_on_tape", lambda e: tg.backward_on_tape(e.tape, e.f32, [e.f32]),
        tg.ShapeError, ("backward_on_tape", "seed")),
    Bad("int_loss", lambda e: tg.backward(e.tape, e.labels, seed=np.ones(2, np.int64)),
        tg.DTypeError, ("backward", "loss", "int64")),
    Bad("wrt_int", lambda e: tg.backward(e.tape, e.s32, wrt=[e.labels]), tg.DTypeError,
        ("backward", "wrt[0]", "int64")),
    Bad("grad_non_scalar", lambda e: tg.grad(tg.exp)(np.ones(3)), tg.ShapeError,
        ("scalar",)),
    # Integer leaves with requires_grad.
    Bad("int_leaf_requires_grad", lambda e: tg.leaf(e.tape, np.arange(3), requires_grad=True),
        tg.DTypeError, ("leaf", "requires_grad", "int64")),
    Bad("bool_leaf_requires_grad", lambda e: tg.leaf(e.tape, np.ones(2, np.bool_),
                                                     requires_grad=True),
        tg.DTypeError, ("leaf", "requires_grad", "bool")),
    Bad("python_int_leaf_requires_grad", lambda e: tg.leaf(e.tape, 3, requires_grad=True),
        tg.DTypeError, ("leaf", "requires_grad")),
    # Something else where the tape goes: None, a string, the arguments swapped.
    Bad("tape_none", lambda e: tg.sum(None, e.f32), tg.TapeError,
        ("sum", "first argument", "tg.Tape", "NoneType")),
    Bad("tape_swapped", lambda e: tg.matmul(e.f32, e.tape, e.w32), tg.TapeError,
        ("matmul", "first argument", "Id", "swapped")),
    Bad("tape_fast_path", lambda e: tg.mul(None, e.f32, 2.0), tg.TapeError,
        ("mul", "first argument", "NoneType")),
    Bad("tape_slow_path", lambda e: tg.add("tape", e.f32, e.f64), tg.TapeError,
        ("add", "first argument", "str")),
    Bad("tape_unary", lambda e: tg.relu(e.f32, e.tape), tg.TapeError,
        ("relu", "first argument", "swapped")),
    Bad("tape_leaf", lambda e: tg.leaf(None, np.ones(2)), tg.TapeError, ("leaf", "NoneType")),
    Bad("tape_value", lambda e: tg.value(e.f32, e.f32), tg.TapeError, ("value", "swapped")),
    Bad("tape_backward", lambda e: tg.backward(None, e.s32), tg.TapeError,
        ("backward", "NoneType")),
    Bad("tape_index_str", lambda e: e.tape["a"], tg.TapeError, ("tape[...]", "int index", "str")),
    # Python ints past the largest float.
    Bad("huge_int_operand", lambda e: tg.add(e.tape, e.f32, 10**400), tg.DTypeError,
        ("add", "'b'", "too large for a float", "401 digits")),
    Bad("huge_int_first_operand", lambda e: tg.sub(e.tape, -(10**400), e.f32), tg.DTypeError,
        ("sub", "'a'", "too large for a float")),
    Bad("huge_int_exponent", lambda e: tg.pow(e.tape, e.f32, 2**1024), tg.DTypeError,
        ("pow", "'b'", "too large for a float")),
    Bad("huge_int_clip_bound", lambda e: tg.clip(e.tape, e.f32, None, 10**400), tg.DTypeError,
        ("clip", "'hi'", "too large for a float")),
    # Devices and allocations.
    Bad("unknown_device", lambda e: tg.Tape("tpu"), tg.DeviceError, ("'tpu'", "cpu")),
    Bad("missing_device", lambda e: tg.Tape("9:9"), tg.DeviceError, ("'9:9'",)),
    Bad("device_int", lambda e: tg.Tape(device=3), tg.DeviceError, ("device", "int")),  # type: ignore[arg-type]
    Bad("huge_broadcast_leaf", lambda e: tg.leaf(e.tape, np.broadcast_to(
        np.float32(1), (2**20, 2**20))), tg.DeviceError, ("(1048576, 1048576)", "bytes")),
    Bad("huge_broadcast_to", lambda e: tg.broadcast_to(e.tape, e.s32, (2**31, 2**31)),
        tg.DeviceError, ("bytes",)),
    Bad("huge_broadcast_add", lambda e: tg.add(e.tape, e.tall, e.wide), tg.DeviceError,
        ("bytes",)),
]


@pytest.fixture
def env() -> Env:
    return Env()


@pytest.mark.parametrize("bad", BAD, ids=[b.name for b in BAD])
def test_bad_input_raises_and_leaves_the_tape_unchanged(env: Env, bad: Bad) -> None:
    tape = env.tape
    length, nodes = len(tape), list(tape)
    store = len(tape._store.nodes)
    assert store == length  # appending to this tape would append to the store in place
    with pytest.raises(tg.TapegradError) as info:
        bad.call(env)
    err = info.value
    assert isinstance(err, bad.error), (
        f"{bad.name}: expected {bad.error.__name__}, got {type(err).__name__}: {err}")
    message = str(err)
    for word in bad.words:
        assert word in message, f"{bad.name}: {word!r} not in message:\n{message}"
    # Nothing half-built: the tape keeps its length and its very nodes, and no node was
    # appended to the store it shares with the tapes grown from it.
    assert env.tape is tape and len(tape) == length
    assert all(a is b for a, b in zip(tape, nodes, strict=True))
    assert len(tape._store.nodes) == store
    grown, y = tg.neg(tape, env.f32)
    assert y.index == length and len(grown) == length + 1


def test_a_failed_op_appends_nothing_to_the_store() -> None:
    """A failure after the first checks (broadcast helpers, casts) leaves no node behind."""
    tape, a = tg.leaf(tg.Tape(), np.ones((2, 1), np.float32))
    tape, b = tg.leaf(tape, np.ones((3,), np.float64))
    tape, c = tg.leaf(tape, np.ones((4, 3), np.float32))
    tape, m = tg.leaf(tape, np.ones((5, 1), np.bool_))
    nodes = list(tape)
    calls: list[Callable[[], Any]] = [
        lambda: tg.add(tape, a, b),  # dtypes
        lambda: tg.add(tape, a, c),  # (2, 1) vs (4, 3)
        lambda: tg.where(tape, a, c, c),  # a float condition
        lambda: tg.where(tape, m, c, a),  # (5, 1), (4, 3), (2, 1)
        lambda: tg.matmul(tape, c, c),  # (4, 3) @ (4, 3)
        lambda: tg.conv2d(tape, c, c),
        lambda: tg.linear(tape, c, a, b),
        lambda: tg.layer_norm(tape, c, weight=a),
        lambda: tg.cross_entropy(tape, c, m),
        lambda: tg.stack(tape, [a, c]),
        lambda: tg.mse(tape, a, c),
    ]
    for call in calls:
        with pytest.raises(tg.TapegradError):
            call()
        assert len(tape._store.nodes) == len(tape) == 4
        assert all(x is y for x, y in zip(tape, nodes, strict=True))


def test_loss_recorded_after_the_tape_it_is_used_on() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(3), requires_grad=True)
    longer, loss = tg.sum(tape, x)
    with pytest.raises(tg.TapeError, match=r"backward: argument 'loss'.*beyond this tape of 1"):
        tg.backward(tape, loss)
    with pytest.raises(tg.TapeError, match="backward_on_tape: argument 'loss'"):
        tg.backward_on_tape(tape, loss, [x])
    assert tg.backward(longer, loss)[x].shape == (3,)


@pytest.mark.parametrize("bad", [b for b in BAD if b.error is not tg.DeviceError],
                         ids=[b.name for b in BAD if b.error is not tg.DeviceError])
def test_message_names_the_callers_line(env: Env, bad: Bad) -> None:
    with pytest.raises(tg.TapegradError) as info:
        bad.call(env)
    assert "test_bad_inputs.py" in str(info.value), str(info.value)


# --- edge inputs that must work -----------------------------------------------------------------


def _values(tape: tg.Tape, y: tg.Id) -> Array:
    return tg.value(tape, y).numpy()


def test_nan_inputs_are_allowed_outside_anomaly_mode() -> None:
    tape, x = tg.leaf(tg.Tape(), np.array([np.nan, -1.0, 4.0], np.float32), requires_grad=True)
    tape, y = tg.log(tape, x)
    tape, s = tg.sqrt(tape, y)
    tape, loss = tg.sum(tape, s)
    assert np.isnan(_values(tape, loss))
    g = tg.backward(tape, loss)[x].numpy()
    assert np.isnan(g[0]) and np.isnan(g[1])
    with tg.detect_anomaly(), pytest.raises(tg.AnomalyError, match="log"):
        tg.log(tape, x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_size_dims_work_where_numpy_works(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    z = np.zeros((0, 3), dtype)
    w = rng.standard_normal((3, 2)).astype(dtype)
    tape, x = tg.leaf(tg.Tape(), z, requires_grad=True)
    tape, wi = tg.leaf(tape, w, requires_grad=True)
    cases: list[tuple[tg.Id, Array]] = []
    table: list[tuple[Callable[[tg.Tape], tuple[tg.Tape, tg.Id]], Any]] = [
        (lambda t: tg.sum(t, x), z.sum()),
        (lambda t: tg.sum(t, x, axis=0), z.sum(0)),
        (lambda t: tg.sum(t, x, axis=1), z.sum(1)),
        (lambda t: tg.max(t, x, axis=1), z.max(1)),
        (lambda t: tg.exp(t, x), np.exp(z)),
        (lambda t: tg.add(t, x, 1.0), z + 1),
        (lambda t: tg.matmul(t, x, wi), z @ w),
        (lambda t: tg.reshape(t, x, (3, -1)), z.reshape(3, -1)),
        (lambda t: tg.transpose(t, x), z.T),
        (lambda t: tg.concat(t, [x, x]), np.concatenate([z, z])),
        (lambda t: tg.pad(t, x, 1), np.pad(z, 1)),
        (lambda t: tg.softmax(t, x), z),
        (lambda t: tg.slice(t, x, np.s_[:, ::-1]), z[:, ::-1]),
    ]
    for fn, want in table:
        tape, y = fn(tape)
        got = _values(tape, y)
        assert got.shape == np.shape(want) and got.dtype == dtype
        np.testing.assert_array_equal(got, want)
        cases.append((y, np.asarray(want)))
    tape, total = tg.sum(tape, cases[0][0])
    grads = tg.backward(tape, total, wrt=[x, wi])
    assert grads[x].shape == (0, 3) and grads[wi].shape == (3, 2)
    np.testing.assert_array_equal(grads[wi].numpy(), np.zeros((3, 2)))
    for y, want in cases[1:]:
        g = tg.backward(tape, y, seed=np.ones(want.shape, dtype), wrt=[x, wi])
        assert g[x].shape == (0, 3)
    tape, m = tg.mean(tape, x)
    assert np.isnan(_values(tape, m))  # numpy's mean of nothing


def test_rank0_values() -> None:
    tape, s = tg.leaf(tg.Tape(), 3.0, requires_grad=True)
    tape, t = tg.leaf(tape, np.float32(-2.0), requires_grad=True)
    tape, y = tg.mul(tape, s, t)
    tape, y = tg.add(tape, y, 1.0)
    tape, y = tg.sum(tape, y)
    tape, y = tg.mean(tape, y, axis=())
    tape, r = tg.reshape(tape, y, (1, 1))
    tape, r = tg.squeeze(tape, r)
    tape, st = tg.stack(tape, [r, s])
    tape, loss = tg.max(tape, st)
    assert loss.shape == () and _values(tape, loss) == np.float32(3.0)
    grads = tg.backward(tape, loss)
    assert grads[s].shape == () and grads[s].numpy() == np.float32(1.0)
    assert grads[t].numpy() == np.float32(0.0)
    tape, e = tg.expand_dims(tape, s, 0)
    tape, b = tg.broadcast_to(tape, s, (2, 2))
    assert e.shape == (1,) and b.shape == (2, 2)
    tape, v = tg.slice(tape, s, np.s_[None, ...])
    assert v.shape == (1,)


# --- copies of more dims than one copy kernel takes (8): numpy handles any rank ---------------


@pytest.mark.parametrize("ndim", [9, 11])
def test_transpose_of_many_dims_works_as_numpy(ndim: int) -> None:
    x = np.random.default_rng(0).standard_normal((2,) * (ndim - 1) + (3,))
    tape, i = tg.leaf(tg.Tape(), x, requires_grad=True)
    tape, y = tg.transpose(tape, i)
    np.testing.assert_array_equal(_values(tape, y), x.T)
    tape, w = tg.leaf(tape, np.random.default_rng(1).standard_normal(x.T.shape))
    tape, p = tg.mul(tape, y, w)
    tape, s = tg.sum(tape, p)
    (g,) = tg.backward(tape, s, wrt=[i]).values()
    np.testing.assert_array_equal(g.numpy(), _values(tape, w).T)


def test_padding_and_broadcasting_many_dims_work_as_numpy() -> None:
    x = np.random.default_rng(2).standard_normal((2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 3))
    tape, i = tg.leaf(tg.Tape(), x)
    target = (2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3)
    tape, b = tg.broadcast_to(tape, i, target)
    np.testing.assert_array_equal(_values(tape, b), np.broadcast_to(x, target))
    widths = [(1, 0)] * 10 + [(0, 1)]
    tape, q = tg.pad(tape, b, widths)
    np.testing.assert_array_equal(_values(tape, q), np.pad(np.broadcast_to(x, target), widths))


def test_broadcast_to_takes_an_int_shape() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(1, np.float32))
    tape, y = tg.broadcast_to(tape, x, 3)
    assert y.shape == (3,)


def test_broadcast_to_refuses_a_float_shape() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones(3, np.float32))
    with pytest.raises(tg.ShapeError, match="broadcast_to"):
        tg.broadcast_to(tape, x, (2.0, 3))  # type: ignore[arg-type]


@pytest.mark.parametrize("op", ["broadcast_to", "add", "leaf"])
def test_allocation_failure_names_the_op(op: str) -> None:
    tape, s = tg.leaf(tg.Tape(), np.float32(1.0))
    tape, tall = tg.broadcast_to(tape, s, (2**18, 1))  # with wide, 256 GiB: too large anywhere
    with pytest.raises(tg.DeviceError, match="add|broadcast_to" if op == "add" else op):
        if op == "broadcast_to":
            tg.broadcast_to(tape, s, (2**31, 2**31))
        elif op == "add":
            tape, wide = tg.broadcast_to(tape, s, (1, 2**18))
            tg.add(tape, tall, wide)
        else:
            tg.leaf(tape, np.broadcast_to(np.float32(1), (2**20, 2**20)))


@pytest.mark.parametrize("op", ["sum", "matmul", "reshape", "softmax"])
def test_a_list_where_an_id_goes_is_a_dtype_error(op: str) -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 2), np.float32))
    calls: dict[str, Callable[[], Any]] = {
        "sum": lambda: tg.sum(tape, [1.0, 2.0]),  # type: ignore[arg-type]
        "matmul": lambda: tg.matmul(tape, [[1.0]], x),  # type: ignore[arg-type]
        "reshape": lambda: tg.reshape(tape, np.ones(4), (2, 2)),  # type: ignore[arg-type]
        "softmax": lambda: tg.softmax(tape, [1.0]),  # type: ignore[arg-type]
    }
    with pytest.raises(tg.TapegradError) as info:
        calls[op]()
    assert isinstance(info.value, tg.DTypeError) and isinstance(info.value, tg.TapeError)


# --- found by the read-only review --------------------------------------------------------------

def test_optimizer_state_of_the_wrong_size_is_refused_not_read_past() -> None:
    p = {"w": tg.AnyTensor.from_numpy(np.ones(300, np.float32))}
    small = {"w": tg.AnyTensor.from_numpy(np.ones(1, np.float32))}
    with pytest.raises(tg.ShapeError, match=r"state\['m'\]\['w'\] has shape \(1,\)"):
        tg.optim.adam(p, p, {"step": 1, "m": small, "v": p})
    with pytest.raises(tg.ShapeError, match="state"):
        tg.optim.sgd(p, p, {"momentum": small}, lr=0.1)
    with pytest.raises(tg.TapegradError, match="state must be None"):
        tg.optim.adam(p, p, {"step": 1})
    with pytest.raises(tg.DTypeError, match="lr must be a number"):
        tg.optim.sgd(p, p, lr="a")  # type: ignore[arg-type]


@pytest.mark.parametrize("op", ["sum", "max", "logsumexp", "log_softmax"])
def test_reducing_a_long_axis_next_to_an_empty_one(op: str) -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((0, 1000), np.float32))
    tape, y = getattr(tg, op)(tape, x, axis=1)
    want = {"log_softmax": (0, 1000)}.get(op, (0,))
    assert tg.value(tape, y).numpy().shape == want


def test_broadcast_to_a_negative_size() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    with pytest.raises(tg.ShapeError, match="negative size"):
        tg.broadcast_to(tape, x, (-2, 2, 3))
    assert len(tape) == 1


def test_public_entry_points_refuse_bad_arguments_with_tapegrad_errors() -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3)), requires_grad=True)
    tape, s = tg.sum(tape, x)
    with pytest.raises(tg.TapeError):
        tg.backward(tape, s, wrt=5)  # type: ignore[arg-type]
    with pytest.raises(tg.DTypeError, match="not a dtype"):
        tg.require(tape, x, (2, 3), "foo")
    with pytest.raises(tg.ShapeError, match="tuple of ints"):
        tg.require(tape, x, 5)  # type: ignore[arg-type]
    with pytest.raises(tg.DTypeError, match="argnums"):
        tg.grad(tg.sum, argnums="a")(np.ones(2))  # type: ignore[arg-type]
    def returns_a_number(t: tg.Tape, v: tg.Id) -> tuple[tg.Tape, int]:
        return t, 3

    def returns_an_id(t: tg.Tape, v: tg.Id) -> tg.Id:
        return v

    with pytest.raises(tg.DTypeError, match=r"f must return \(tape, id\)"):
        tg.jacobian(returns_a_number, np.ones(2))
    with pytest.raises(tg.DTypeError, match=r"f must return \(tape, id\)"):
        tg.gradcheck(returns_an_id, np.ones(2))
    # JAX's habit, f(x) without the tape: named as such, not Python's bare arity TypeError
    # (which a TypeError inside f stays)
    with pytest.raises(tg.ArgumentTypeError, match=r"^value_and_grad: f is called as "
                       r"f\(tape, \*args\), the tape first, with 1 argument after it"):
        tg.value_and_grad(lambda v: v)(np.ones(2))  # type: ignore[arg-type]
    with pytest.raises(tg.ArgumentTypeError, match=r"^grad: .* with 2 arguments after it"):
        tg.grad(lambda t, v: tg.sum(t, v))(np.ones(2), np.ones(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"has no len\(\)") as inside:
        tg.grad(lambda t, v: (t, len(cast(Any, 3))))(np.ones(2))
    assert not isinstance(inside.value, tg.TapegradError)
    # an op inside f called with arguments it does not take is that op's error, not grad's
    with pytest.raises(tg.ArgumentTypeError, match=r"^sum: sum\(\) takes from 2 to 4 "
                       r"positional arguments"):
        tg.grad(lambda t, v: tg.sum(t, v, 0, False, 1))(np.ones(2))  # type: ignore[call-arg]
    with pytest.raises(tg.DTypeError, match="too large for int64"):
        tg.leaf(tape, 2**70)
    with pytest.raises(tg.DTypeError, match="backward: seed is an int too large for a float"):
        tg.backward(tape, s, seed=10**400)


def test_custom_op_names_are_checked_before_anything_is_registered() -> None:
    tg.elementwise_op("review_vjp0", 1, "a", [None])
    with pytest.raises(tg.TapegradError, match="'review_vjp0' already exists"):
        tg.elementwise_op("review", 1, "a", ["g"])
    op = tg.elementwise_op("review2", 1, "a * (T)2", ["g * (T)2"])  # the failed name left nothing
    tape, x = tg.leaf(tg.Tape(), np.ones(2, np.float32))
    tape, y = op(tape, x)
    np.testing.assert_allclose(tg.value(tape, y).numpy(), [2.0, 2.0])


def test_tensors_from_another_device_are_refused() -> None:
    first = tg.default_device()
    other = tg.Device(first.platform_index, first.device_index, first.cl_device)
    tape, x = tg.leaf(tg.Tape(first), np.ones(3), requires_grad=True)
    tape, y = tg.mul(tape, x, 2.0)
    foreign = tg.AnyTensor.from_numpy(np.ones(3), other)
    with pytest.raises(tg.DeviceError, match="seed is on"):
        tg.backward(tape, y, seed=foreign)
    with pytest.raises(tg.DeviceError, match="tape is on"):
        tg.leaf(tape, foreign)
    with pytest.raises(tg.DeviceError, match=r"grads\[0\] is on"):
        tg.optim.sgd([tg.AnyTensor.from_numpy(np.ones(3), first)], [foreign], lr=0.1)


@pytest.mark.parametrize("axis", [1.0, "0", True, None], ids=["float", "str", "bool", "None"])
def test_an_axis_of_the_wrong_type_is_a_type_error_and_a_shape_error(axis: Any) -> None:
    """numpy and PyTorch raise TypeError for a float or str axis; tapegrad's ShapeError (a
    ValueError) alone failed `except TypeError`. ArgumentTypeError is both."""
    tape, x = tg.leaf(tg.Tape(), np.ones((2, 3), np.float32))
    calls: list[Callable[[], object]] = [
        lambda: tg.expand_dims(tape, x, axis), lambda: tg.softmax(tape, x, axis=axis),
        lambda: tg.concat(tape, [x, x], axis=axis)]
    if axis is not None:  # None is a valid axis for reductions (all of them)
        calls.append(lambda: tg.sum(tape, x, axis=axis))
    for call in calls:
        with pytest.raises(tg.ShapeError, match=r"axis.*\n  \(called at .*test_bad_inputs"
                           ) as caught:
            call()
        assert isinstance(caught.value, TypeError | tg.DTypeError)
    for shape in [(2.0, 3), "6", None]:
        with pytest.raises(TypeError, match="reshape: shape must be an int or a sequence"):
            tg.reshape(tape, x, shape)
    tape, img = tg.leaf(tape, np.ones((1, 1, 4, 4), np.float32))
    tape, w = tg.leaf(tape, np.ones((1, 1, 2, 2), np.float32))
    with pytest.raises(TypeError, match="conv2d: stride must be an int or a pair of ints"):
        tg.conv2d(tape, img, w, stride=1.5)
    with pytest.raises(tg.ShapeError, match="conv2d: stride must be an int or a pair") as caught:
        tg.conv2d(tape, img, w, stride=(1, 1, 1))  # a wrong length: a value error only
    assert not isinstance(caught.value, TypeError)
    with pytest.raises(TypeError, match="gelu: approximate must be the str"):
        tg.gelu(tape, x, approximate=True)
    with pytest.raises(tg.ShapeError, match="gelu: approximate must be 'none'"):
        tg.gelu(tape, x, approximate="erf")


def test_sizes_numpy_cannot_hold_are_refused_even_with_no_elements() -> None:
    tape, z = tg.leaf(tg.Tape(), np.ones((0, 3), np.float32))
    with pytest.raises(tg.ShapeError, match=r"reshape: shape .* past numpy's limit"):
        tg.reshape(tape, z, (2**64, 0))
    with pytest.raises(tg.ShapeError, match=r"broadcast_to: shape .* past numpy's limit"):
        tg.broadcast_to(tape, z, (2**64, 0, 3))
    # each size representable, their product (zeros aside) not: numpy refuses the shape too
    for shape in [(0, 2**62, 4), (-1, 2**62, 4)]:  # -1 resolved to 0 too
        with pytest.raises(tg.ShapeError, match=r"reshape: shape \(0, 4611686018427387904, 4\)"
                                                r" is too big: beside its zero-sized axis"):
            tg.reshape(tape, z, shape)
    with pytest.raises(ValueError, match="too big"):
        np.empty((0, 2**62, 4), np.float32)
    tape, r = tg.reshape(tape, z, (2**40, 0))  # large but representable: numpy holds it
    assert tg.value(tape, r).numpy().shape == (2**40, 0)
    tape, r = tg.reshape(tape, z, (0, 2**40, 2**19))
    assert tg.value(tape, r).numpy().shape == (0, 2**40, 2**19)


def test_transform_and_helper_arguments_are_checked() -> None:
    def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, y = tg.mul(tape, x, x)
        return tg.sum(tape, y)

    x3 = np.ones(3, np.float32)
    for v in ["abc", {"a": 1}, None, np.array([1 + 5j] * 3)]:  # None was a silent NaN
        with pytest.raises(tg.DTypeError, match=r"hvp: v must be an AnyTensor or real numbers"):
            tg.hvp(f, x3, v)
    np.testing.assert_allclose(tg.hvp(f, x3, [1, 0, 0]).numpy(), [2.0, 0.0, 0.0])
    # Any real dtype, converted once to x's: a Python 0.1 stays exact for a float64 x.
    np.testing.assert_array_equal(tg.hvp(f, x3, np.ones(3, np.float16)).numpy(), [2.0] * 3)
    assert tg.hvp(f, np.array(2.0), 0.1).numpy().item() == 2 * 0.1
    assert tg.gradcheck(f, x3.astype(np.float64), seed=None)  # fresh randomness
    for seed, kind in [(-1, tg.ShapeError), ("a", tg.DTypeError), (1.5, tg.DTypeError)]:
        with pytest.raises(kind, match="gradcheck: seed must be an int >= 0"):
            tg.gradcheck(f, x3.astype(np.float64), seed=seed)
    with pytest.raises(tg.ShapeError, match="gradcheck: eps must be a finite number > 0"):
        tg.gradcheck(f, x3.astype(np.float64), eps=float("inf"))
    tape, _ = tg.leaf(tg.Tape(), x3)
    with pytest.raises(tg.DTypeError, match="render: path must be a str or a path"):
        tg.render(tape, None)
    with pytest.raises(tg.DTypeError, match="typed: decorates a function"):
        tg.typed(3)
    state = {"step": 10**400, "m": [x3], "v": [x3]}  # was an OverflowError
    params, state = tg.optim.adam([x3], [x3], state)
    assert state["step"] == 10**400 + 1 and np.isfinite(params[0].numpy()).all()


def test_backward_on_tape_takes_wrt_none_as_backward_does() -> None:
    """`wrt=None`: every requires_grad leaf the loss reaches (it was a bare AssertionError)."""
    tape, x = tg.leaf(tg.Tape(), np.array([1.0, 2.0]), requires_grad=True)
    tape, unused = tg.leaf(tape, np.array([1.0, 2.0]), requires_grad=True)
    tape, y = tg.mul(tape, x, x)
    tape, loss = tg.sum(tape, y)
    for grown, grads in [tg.backward_on_tape(tape, loss, None)]:
        assert list(grads) == [x] and unused not in grads
        np.testing.assert_array_equal(tg.value(grown, grads[x]).numpy(), [2.0, 4.0])


def test_errors_name_the_function_the_user_called() -> None:
    """grad's errors said "value_and_grad:", an int array given to grad "leaf:", a float id
    given to embedding "take:"."""
    def f(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, y = tg.mul(tape, x, x)
        return tg.sum(tape, y)

    with pytest.raises(tg.ShapeError, match=r"^grad: argnums 3 is out of range"):
        tg.grad(f, argnums=3)(np.ones(2))
    with pytest.raises(tg.DTypeError, match=r"^grad: argument 0 has dtype int64, but gradients "
                       r"exist only for float32 or float64 data"):
        tg.grad(f)(np.array([1, 2]))
    with pytest.raises(tg.DTypeError, match=r"^jacobian: argument 0 has dtype int64"):
        tg.jacobian(f)(np.array([1, 2]))
    tape, table = tg.leaf(tg.Tape(), np.ones((4, 3), np.float32))
    tape, ids = tg.leaf(tape, np.array([1, 2]))
    with pytest.raises(tg.DTypeError, match=r"^embedding: indices has dtype float32, expected "
                       r"int32 or int64 \(are table and indices swapped\?\)"):
        tg.embedding(tape, ids, table)
    with pytest.raises(tg.DTypeError, match=r"^mean: needs a float32 or float64 tensor, got "
                       r"int64 \(convert with tg.astype"):
        tg.mean(tape, ids)


def test_composites_and_helpers_raise_named_subclasses_at_the_users_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    tape, x = tg.leaf(tg.Tape(), np.ones((4, 3), np.float32), requires_grad=True)
    tape, loss = tg.sum(tape, x)
    grads = tg.backward(tape, loss)
    with pytest.raises(tg.ShapeError, match=r"tg.backward's result is keyed by Id"):
        tg.optim.sgd({"w": x}, grads, lr=0.1)
    with pytest.raises(tg.DTypeError, match=r"sgd: state must be None or the dict"):
        tg.optim.sgd([np.ones(3)], [np.ones(3)], state=[1.0], lr=0.1, momentum=0.9)
    with pytest.raises(tg.TapeError, match=r"add: a and b are both numbers") as caught:
        tg.add(tape, 1.0, 2.0)
    assert isinstance(caught.value, tg.DTypeError)
    op = tg.elementwise_op("bad_inputs_twice", 1, "a * (T)2", ["g * (T)2"])
    with pytest.raises(tg.DTypeError, match=r"bad_inputs_twice: takes 1 operands, got 2"):
        op(tape, x, x)
    with pytest.raises(tg.ShapeError, match=r"render: cannot tell the image format"):
        tg.render(tape, "graph.txt")
    # Entered through contextlib: the site is still the user's.
    with (pytest.raises(tg.DTypeError, match=r"detect_anomaly.*\n  \(called at .*test_bad_in"),
          tg.detect_anomaly("yes")):
        pass
    from tapegrad import _device

    def refuse(device: Any, nbytes: int) -> Any:
        raise tg.DeviceError(f"cannot allocate {nbytes} bytes")

    monkeypatch.setattr(_device.Device, "allocate", refuse)
    with deferring(False), pytest.raises(tg.DeviceError,
                                         match=r"^var: mean: sum: .*cannot allocate"):
        tg.var(tape, x, axis=0)  # a step of the composite: the public op is named first
    # Deferred (the default), a forward's kernels run when its value is first needed: the
    # error names the public op, the step and the line that recorded it.
    tape, v = tg.var(tape, x, axis=0)
    with pytest.raises(tg.DeviceError, match=r"^var: sum: .*cannot allocate.*\n  \(called at "
                       r".*\n  \(recorded at .*test_bad_inputs"):
        tg.value(tape, v).numpy()


def test_vjp_functions_and_gradcheck_failures_say_what_and_where() -> None:
    def square(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        return tg.mul(tape, x, x)

    _, eager = tg.vjp(square, np.ones(3))
    with pytest.raises(tg.ShapeError, match=r"^vjp's function: the cotangent: backward: seed "
                       r"has shape \(4,\).*\n  \(called at .*test_bad_inputs"):
        eager(np.ones(4))
    tape, x = tg.leaf(tg.Tape(), np.ones(3))
    _, recorded = tg.vjp(square, tape, x)
    other, ct = tg.leaf(tape, np.ones(3))  # the tape before vjp's, grown another way
    with pytest.raises(tg.TapeError, match=r"call it with the tape tg.vjp returned"):
        recorded(other, ct)

    def wrong(tape: tg.Tape, x: tg.Id) -> tuple[tg.Tape, tg.Id]:
        tape, frozen = tg.stop_gradient(tape, x)
        tape, y = tg.mul(tape, frozen, x)
        return tg.sum(tape, y)

    with pytest.raises(tg.GradcheckError, match=r"gradcheck failed.*\n  \(called at .*test_bad"):
        tg.gradcheck(wrong, np.ones(2))
