// Validation tests: one test per rule of src/validate.cpp and src/tensor.cpp.
//
// Every invalid call must throw flashattn::Error with the expected ErrorCode and a what() that
// names the argument and the constraint, and must leave every tensor bit-identical (outputs are
// pre-filled with NaN bytes; the bytes of every tensor are compared before and after). Each rule
// is checked on all entry points of a family that share the validation: the run, its
// *_workspace_size query and its reference_* (dense or varlen, forward and/or backward).
// The accepting side (valid edge cases) is test_validation_accepts.cpp; the harness,
// validation_harness.hpp.
#include "validation_harness.hpp"

namespace {

using namespace fa_validation;

// =============================================================================================
// Presence, rank and dtype
// =============================================================================================
TEST(Validation, MissingQ) {
  each_mode([](Call& s) {
    s.q = TensorView{};
    EXPECT_TRUE(s.all_fail(kArg, {"q: missing"}));
  });
}

TEST(Validation, MissingOtherTensorNamesIt) {
  each_mode([](Call& s) {
    s.v = TensorView{};
    EXPECT_TRUE(s.all_fail(kArg, {"v: ndim 0 != expected " + std::to_string(s.nd())}));
  });
}

TEST(Validation, WrongNdimEachTensor) {
  for (const char* name : {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"}) {
    each_mode([&](Call& s) {
      SCOPED_TRACE(name);
      const int expected = std::string(name) == "lse" ? s.nd() - 1 : s.nd();
      s[name].ndim = expected - 1;
      const std::string msg =
          std::string(name) + ": ndim " + std::to_string(expected - 1) + " != expected " + std::to_string(expected);
      const std::string n(name);
      if (n == "q" || n == "k" || n == "v" || n == "out" || n == "lse") {
        EXPECT_TRUE(s.fwd_fails(kArg, {msg}));
      }
      EXPECT_TRUE(s.bwd_fails(kArg, {msg}));
    });
  }
}

TEST(Validation, NdimAboveMaxDimsIsRejectedWithoutReadingPastTheArrays) {
  each_mode([](Call& s) {
    s.q.ndim = 5;
    EXPECT_TRUE(s.all_fail(kArg, {"q: ndim 5 != expected " + std::to_string(s.nd())}));
  });
}

TEST(Validation, NonFloatDtype) {
  each_mode([](Call& s) {
    s.q.dtype = DType::kInt32;
    EXPECT_TRUE(s.all_fail(kDtype, {"q: dtype int32", "float16, bfloat16, float32, float64"}));
  });
  each_mode([](Call& s) {
    s.dout.dtype = DType::kInt32;
    EXPECT_TRUE(s.bwd_fails(kDtype, {"dout: dtype int32 is not one of"}));
  });
}

TEST(Validation, UnknownDtypeOrDeviceEnum) {
  each_mode([](Call& s) {
    s.q.dtype = static_cast<DType>(99);
    EXPECT_TRUE(s.all_fail(kDtype, {"q: unknown dtype"}));
  });
  each_mode([](Call& s) {
    s.k.device.type = static_cast<DeviceType>(7);
    EXPECT_TRUE(s.all_fail(kArg, {"k: unknown device type"}));
  });
}

TEST(Validation, DtypeMismatch) {
  Dims d;
  d.dtype = DType::kFloat16;
  each_mode(
      [](Call& s) {
        s.k.dtype = DType::kBFloat16;
        EXPECT_TRUE(s.all_fail(kDtype, {"k: dtype bfloat16 != q dtype float16"}));
      },
      d);
  each_mode(
      [](Call& s) {
        s.out.dtype = DType::kFloat32;
        EXPECT_TRUE(s.all_fail(kDtype, {"out: dtype float32 != q dtype float16"}));
      },
      d);
  each_mode(
      [](Call& s) {
        s.dv.dtype = DType::kBFloat16;
        EXPECT_TRUE(s.bwd_fails(kDtype, {"dv: dtype bfloat16 != q dtype float16"}));
      },
      d);
}

TEST(Validation, LseNotFloat32) {
  each_mode([](Call& s) {
    s.lse.dtype = DType::kFloat16;
    EXPECT_TRUE(s.all_fail(kDtype, {"lse: dtype float16 must be float32"}));
    s.lse.dtype = DType::kFloat64;
    EXPECT_TRUE(s.all_fail(kDtype, {"lse: dtype float64 must be float32"}));
  });
}

TEST(Validation, AlibiNotFloat32) {
  each_mode([](Call& s) {
    s.opt.score.alibi_slopes = s.tensor(DType::kFloat64, {s.dims().heads_q});
    EXPECT_TRUE(s.all_fail(kDtype, {"alibi_slopes: dtype float64 must be float32"}));
  });
}

TEST(Validation, CuSeqlensNotInt32) {
  {
    Call s(varlen_dims());
    s.vl.cu_seqlens_q = s.tensor(DType::kFloat32, {3});
    EXPECT_TRUE(s.all_fail(kDtype, {"cu_seqlens_q: dtype float32 must be int32"}));
  }
  {
    Call s(varlen_dims());
    s.vl.cu_seqlens_k.dtype = DType::kFloat32;
    EXPECT_TRUE(s.all_fail(kDtype, {"cu_seqlens_k: dtype float32 must be int32"}));
  }
  {
    Call s(varlen_dims());
    s.vl.seqused_k = s.tensor(DType::kFloat32, {2});
    EXPECT_TRUE(s.all_fail(kDtype, {"seqused_k: dtype float32 must be int32"}));
  }
}

// =============================================================================================
// Devices
// =============================================================================================
TEST(Validation, DeviceMismatchNamesTheTensor) {
  each_mode([](Call& s) {
    s.k.device = kCuda0;
    EXPECT_TRUE(s.all_fail(kArg, {"k: on cuda:0 but q is on cpu"}));
  });
  each_mode([](Call& s) {
    s.lse.device = kCuda0;
    EXPECT_TRUE(s.all_fail(kArg, {"lse: on cuda:0 but q is on cpu"}));
  });
  each_mode([](Call& s) {
    s.dq.device = kCuda0;
    EXPECT_TRUE(s.bwd_fails(kArg, {"dq: on cuda:0 but q is on cpu"}));
  });
  each_mode([](Call& s) {
    s.opt.score.alibi_slopes = with_device(s.tensor(DType::kFloat32, {4}), kCuda0);
    EXPECT_TRUE(s.all_fail(kArg, {"alibi_slopes: on cuda:0 but q is on cpu"}));
  });
  {
    Call s(varlen_dims());
    s.vl.cu_seqlens_k.device = kCuda0;
    EXPECT_TRUE(s.all_fail(kArg, {"cu_seqlens_k: on cuda:0 but q is on cpu"}));
  }
  each_mode([](Call& s) {  // two CUDA devices
    for (const char* n : {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"}) s[n].device = kCuda0;
    s.v.device = Device{DeviceType::kCUDA, 1};
    s.vl.cu_seqlens_q.device = s.vl.cu_seqlens_k.device = kCuda0;
    EXPECT_TRUE(s.all_fail(kArg, {"v: on cuda:1 but q is on cuda:0"}));
  });
}

TEST(Validation, CudaTensorsAreUnsupportedWithoutADevice) {
  // Host pointers labelled cuda:0 must never reach a device: only run where there is none.
  if (flashattn::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  each_mode([](Call& s) {
    for (const char* n : {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"}) s[n].device = kCuda0;
    s.vl.cu_seqlens_q.device = s.vl.cu_seqlens_k.device = kCuda0;
    if (!s.varlen()) {
      EXPECT_TRUE(s.fails({"fwd", "fwd_ws", "bwd", "bwd_ws"}, ErrorCode::kUnsupported, {"q: tensors on cuda:0"}));
      EXPECT_TRUE(s.fails({"fwd_ref", "bwd_ref"}, kArg, {"q: the reference runs on CPU tensors only"}));
    } else {
      EXPECT_TRUE(s.all_fail(ErrorCode::kUnsupported, {"cu_seqlens_q: varlen on cuda:0 needs"}));
    }
  });
}

// =============================================================================================
// Shapes
// =============================================================================================
TEST(Validation, HeadDimZero) {
  Dims d;
  d.head_dim = 0;
  each_mode([](Call& s) { EXPECT_TRUE(s.all_fail(kArg, {"q: head_dim 0 outside [1, 576]"})); }, d);
}

TEST(Validation, HeadDim577) {
  Dims d;
  d.head_dim = 577;
  each_mode([](Call& s) { EXPECT_TRUE(s.all_fail(kArg, {"q: head_dim 577 outside [1, 576]"})); }, d);
}

TEST(Validation, KHeadDimDiffersFromQ) {
  Dims d;
  d.head_dim = 64;
  each_mode(
      [](Call& s) {
        auto ks = s.shape_of(s.k);
        ks.back() = 72;
        s.k = s.tensor(s.dims().dtype, ks);
        EXPECT_TRUE(s.all_fail(kArg, {"k: head_dim 72 != q head_dim 64"}));
      },
      d);
}

TEST(Validation, VShapeDiffersFromK) {
  each_mode([](Call& s) {
    for (int dim = 0; dim < s.nd() - 1; ++dim) {  // (v's head_dim may differ: test_value_head_dim)
      SCOPED_TRACE(dim);
      auto vs = s.shape_of(s.k);
      vs[dim] += 1;
      const TensorView saved = s.v;
      s.v = s.tensor(s.dims().dtype, vs);
      EXPECT_TRUE(s.all_fail(kArg, {"v: shape [", "] != k shape ["}));
      s.v = saved;
    }
  });
}

TEST(Validation, HeadsQNotMultipleOfHeadsKv) {
  Dims d;
  d.heads_kv = 3;
  each_mode([](Call& s) { EXPECT_TRUE(s.all_fail(kArg, {"k: heads 3 must divide q heads 4"})); }, d);
  d.heads_kv = 0;
  each_mode([](Call& s) { EXPECT_TRUE(s.all_fail(kArg, {"k: heads must be >= 1"})); }, d);
  d.heads_kv = 2;
  d.heads_q = 0;
  each_mode([](Call& s) { EXPECT_TRUE(s.all_fail(kArg, {"q: heads must be >= 1"})); }, d);
}

TEST(Validation, BatchMismatch) {
  Call s;  // dense only: varlen tensors have no batch dimension
  s.k = s.tensor(DType::kFloat32, {3, 5, 2, 8});
  s.v = s.tensor(DType::kFloat32, {3, 5, 2, 8});
  EXPECT_TRUE(s.all_fail(kArg, {"k: batch 3 != q batch 2"}));
}

TEST(Validation, OutShapeDiffersFromQ) {
  each_mode([](Call& s) {
    for (int dim = 0; dim < s.nd(); ++dim) {
      SCOPED_TRACE(dim);
      auto os = s.shape_of(s.q);
      os[dim] += 1;
      const TensorView saved = s.out;
      s.out = s.output(s.dims().dtype, os);
      EXPECT_TRUE(s.all_fail(kArg, {"out: shape [", "] != q shape ["}));
      s.out = saved;
    }
  });
}

TEST(Validation, LseShapeEachDim) {
  {
    Call s;
    s.lse = s.output(DType::kFloat32, {3, 4, 3});
    EXPECT_TRUE(s.all_fail(kArg, {"lse: batch 3 != q batch 2"}));
    s.lse = s.output(DType::kFloat32, {2, 5, 3});
    EXPECT_TRUE(s.all_fail(kArg, {"lse: heads 5 != q heads 4"}));
    s.lse = s.output(DType::kFloat32, {2, 4, 4});
    EXPECT_TRUE(s.all_fail(kArg, {"lse: seqlen 4 != q seqlen 3"}));
  }
  {
    Call s(varlen_dims());  // total_q 6
    s.lse = s.output(DType::kFloat32, {5, 6});
    EXPECT_TRUE(s.all_fail(kArg, {"lse: heads 5 != q heads 4"}));
    s.lse = s.output(DType::kFloat32, {4, 7});
    EXPECT_TRUE(s.all_fail(kArg, {"lse: total_q 7 != q total_q 6"}));
  }
}

TEST(Validation, GradientShapes) {
  each_mode([](Call& s) {
    const std::vector<std::pair<const char*, const char*>> cases = {
        {"dout", "q"}, {"dq", "q"}, {"dk", "k"}, {"dv", "v"}};
    for (auto [name, ref] : cases) {
      SCOPED_TRACE(name);
      auto shape = s.shape_of(s[ref]);
      shape[1] += 1;
      const TensorView saved = s[name];
      s[name] = s.output(s.dims().dtype, shape);
      EXPECT_TRUE(s.bwd_fails(kArg, {std::string(name) + ": shape [", std::string("] != ") + ref + " shape ["}));
      s[name] = saved;
    }
  });
}

// =============================================================================================
// Strides, pointers and sizes
// =============================================================================================
TEST(Validation, HeadDimStrideNotOne) {
  for (const char* name : {"q", "k", "v", "out", "dout", "dq", "dk", "dv"}) {
    each_mode([&](Call& s) {
      SCOPED_TRACE(name);
      TensorView& t = s[name];
      auto shape = s.shape_of(t);
      std::vector<int64_t> strides(shape.size());
      int64_t st = 2;  // row-major, but every head_dim element 2 apart
      for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
        strides[i] = st;
        st *= shape[i];
      }
      t = s.tensor(s.dims().dtype, shape, strides, true);
      const std::string msg = std::string(name) + ": head_dim stride 2 must be 1";
      const std::string n(name);
      if (n == "q" || n == "k" || n == "v" || n == "out") {
        EXPECT_TRUE(s.fwd_fails(kArg, {msg}));
      }
      EXPECT_TRUE(s.bwd_fails(kArg, {msg}));
    });
  }
}

TEST(Validation, NegativeShape) {
  each_mode([](Call& s) {
    s.q.shape[1] = -3;
    EXPECT_TRUE(s.all_fail(kArg, {"q: negative size in shape ["}));
  });
  each_mode([](Call& s) {
    s.dv.shape[0] = -1;
    EXPECT_TRUE(s.bwd_fails(kArg, {"dv: negative size in shape [-1, "}));
  });
}

TEST(Validation, NegativeStride) {
  each_mode([](Call& s) {
    s.k.strides[0] = -s.k.strides[0];
    EXPECT_TRUE(s.all_fail(kArg, {"k: stride[0] -", "< 0 (negative strides are not supported)"}));
  });
}

TEST(Validation, NullDataWithNonEmptyShape) {
  each_mode([](Call& s) {
    s.k.data = nullptr;
    EXPECT_TRUE(s.all_fail(kArg, {"k: data is null"}));
  });
  each_mode([](Call& s) {
    s.out.data = nullptr;
    EXPECT_TRUE(s.all_fail(kArg, {"out: data is null"}));
  });
  each_mode([](Call& s) {
    s.dq.data = nullptr;
    EXPECT_TRUE(s.bwd_fails(kArg, {"dq: data is null"}));
  });
}

TEST(Validation, MisalignedPointer) {
  each_mode([](Call& s) {
    s.q = offset_bytes(s.q, 1);  // fp32 at an odd address
    EXPECT_TRUE(s.all_fail(kArg, {"q: data pointer is not aligned to its 4-byte dtype"}));
  });
  each_mode([](Call& s) {
    s.lse = offset_bytes(s.lse, 2);
    EXPECT_TRUE(s.all_fail(kArg, {"lse: data pointer is not aligned to its 4-byte dtype"}));
  });
  Dims d;
  d.dtype = DType::kBFloat16;
  each_mode(
      [](Call& s) {
        s.dk = offset_bytes(s.dk, 1);
        EXPECT_TRUE(s.bwd_fails(kArg, {"dk: data pointer is not aligned to its 2-byte dtype"}));
      },
      d);
}

TEST(Validation, SizeOverflowsInt64) {
  const int64_t p40 = int64_t{1} << 40, p30 = int64_t{1} << 30;
  {
    Call s;  // numel 2^73
    s.q = TensorView::contiguous(s.q.data, DType::kFloat32, {p40, p30, 1, 8});
    EXPECT_TRUE(s.all_fail(kArg, {"q: size of shape [1099511627776, 1073741824, 1, 8] overflows"}));
  }
  {
    Call s(varlen_dims());
    s.q = TensorView::contiguous(s.q.data, DType::kFloat32, {p40, p30, 16});
    EXPECT_TRUE(s.all_fail(kArg, {"q: size of shape [1099511627776, 1073741824, 16] overflows"}));
  }
  each_mode([](Call& s) {  // largest offset about 2^62 fits, its byte size does not
    s.k.strides[0] = (int64_t{1} << 62) / (s.k.shape[0] - 1);
    EXPECT_TRUE(s.all_fail(kArg, {"k: byte size of shape", "overflows 64 bits"}));
  });
  each_mode([](Call& s) {  // largest offset exactly INT64_MAX: extent + 1 overflows
    int64_t rest = 0;
    for (int i = 1; i < s.v.ndim; ++i) rest += (s.v.shape[i] - 1) * s.v.strides[i];
    s.v.shape[0] = 2;
    s.v.strides[0] = kInt64Max - rest;
    EXPECT_TRUE(s.all_fail(kArg, {"v: byte size of shape", "overflows 64 bits"}));
  });
  each_mode([](Call& s) {  // a span past INT64_MAX
    s.dout.strides[0] = kInt64Max;
    EXPECT_TRUE(s.bwd_fails(kArg, {"dout: size of shape", "overflows 64-bit offsets"}));
  });
}

TEST(Validation, TensorViewHelpers) {
  const int64_t p40 = int64_t{1} << 40, p30 = int64_t{1} << 30;
  try {
    (void)TensorView::contiguous(nullptr, DType::kFloat32, {2, p40, p30, 8});
    ADD_FAILURE() << "contiguous() accepted strides that overflow int64";
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(e.code(), kArg);
    EXPECT_NE(std::string(e.what()).find("shape: [2, 1099511627776, 1073741824, 8] overflows"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW((void)TensorView::contiguous(nullptr, DType::kFloat32, {p40, p30, 1, 8}));
  try {
    (void)TensorView::strided(nullptr, DType::kFloat32, {2, 3}, {3});
    ADD_FAILURE() << "strided() accepted 1 stride for 2 dims";
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(e.code(), kArg);
    EXPECT_NE(std::string(e.what()).find("strides: 1 entries for 2 dims"), std::string::npos);
  }
  try {
    (void)TensorView::contiguous(nullptr, DType::kFloat32, {1, 2, 3, 4, 5});
    ADD_FAILURE() << "contiguous() accepted 5 dims";
  } catch (const flashattn::Error& e) {
    EXPECT_EQ(e.code(), kArg);
    EXPECT_NE(std::string(e.what()).find("shape: 5 dims, at most 4"), std::string::npos);
  }
}

// =============================================================================================
// Options
// =============================================================================================
TEST(Validation, WindowLeftBelowMinusOne) {
  each_mode([](Call& s) {
    s.opt.mask.window_left = -2;
    EXPECT_TRUE(s.all_fail(kArg, {"window_left: -2 must be >= -1"}));
  });
}

TEST(Validation, WindowRightBelowMinusOne) {
  each_mode([](Call& s) {
    s.opt.mask.window_right = -5;
    EXPECT_TRUE(s.all_fail(kArg, {"window_right: -5 must be >= -1"}));
  });
}

TEST(Validation, CausalWithPositiveWindowRight) {
  each_mode([](Call& s) {
    s.opt.mask.causal = true;
    s.opt.mask.window_right = 5;
    EXPECT_TRUE(s.all_fail(kArg, {"window_right: 5 conflicts with causal"}));
  });
}

TEST(Validation, SoftcapNegativeOrNotFinite) {
  each_mode([](Call& s) {
    for (float c : {-1.0f, kNaN, kInf, -kInf}) {
      SCOPED_TRACE(c);
      s.opt.score.softcap = c;
      EXPECT_TRUE(s.all_fail(kArg, {"softcap: ", "must be finite and >= 0"}));
    }
  });
}

TEST(Validation, SoftmaxScaleNotFinite) {
  each_mode([](Call& s) {
    for (double sc :
         {std::nan(""), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
      SCOPED_TRACE(sc);
      s.opt.score.softmax_scale = sc;
      EXPECT_TRUE(s.all_fail(kArg, {"softmax_scale: must be finite"}));
    }
  });
}

// The kernels take the scale and the softcap as fp32 (with log2(e), and softcap's inverse): a
// value that overflows there, or is denormal, would turn every score into inf, 0 or NaN.
TEST(Validation, ScaleAndSoftcapOutsideFp32) {
  each_mode([](Call& s) {
    for (double sc : {1e300, 3e38, -3e38, 1e-300, 1e-40}) {
      SCOPED_TRACE(sc);
      s.opt.score.softmax_scale = sc;
      EXPECT_TRUE(s.all_fail(kArg, {"softmax_scale: ", "is not a normal fp32 number"}));
    }
  });
  each_mode([](Call& s) {
    for (float cap : {3e38f, 1.4e-45f, 1e-39f}) {
      SCOPED_TRACE(cap);
      s.opt.score.softcap = cap;
      EXPECT_TRUE(s.all_fail(kArg, {"softcap: ", "out of fp32's normal range"}));
    }
  });
}

TEST(Validation, DropoutOutsideZeroOne) {
  each_mode([](Call& s) {
    for (float p : {-0.1f, 1.0f, 1.5f, kNaN, kInf}) {
      SCOPED_TRACE(p);
      s.opt.dropout.p = p;
      EXPECT_TRUE(s.all_fail(kArg, {"dropout_p: ", "must be in [0, 1)"}));
    }
  });
}

TEST(Validation, AlibiShape) {
  each_mode([](Call& s) {
    s.opt.score.alibi_slopes = s.tensor(DType::kFloat32, {5});
    EXPECT_TRUE(s.all_fail(kArg, {"alibi_slopes: heads 5 != q heads 4"}));
    s.opt.score.alibi_slopes = s.tensor(DType::kFloat32, {3, 4});
    EXPECT_TRUE(s.all_fail(kArg, {"alibi_slopes: batch 3 != batch 2"}));
    s.opt.score.alibi_slopes = s.tensor(DType::kFloat32, {2, 3});
    EXPECT_TRUE(s.all_fail(kArg, {"alibi_slopes: heads 3 != q heads 4"}));
    s.opt.score.alibi_slopes = s.tensor(DType::kFloat32, {2, 4, 1});
    EXPECT_TRUE(s.all_fail(kArg, {"alibi_slopes: ndim 3 must be 1 [heads] or 2 [batch, heads]"}));
    s.opt.score.alibi_slopes = TensorView::contiguous(nullptr, DType::kFloat32, {4});
    EXPECT_TRUE(s.all_fail(kArg, {"alibi_slopes: data is null"}));
  });
}

TEST(Validation, SinkTokens) {
  each_mode([](Call& s) {
    s.opt.mask.sink_tokens = -1;
    EXPECT_TRUE(s.all_fail(kArg, {"sink_tokens: -1 must be >= 0"}));
  });
}

TEST(Validation, LearnableSink) {
  each_mode([](Call& s) {
    s.opt.score.learnable_sink = s.tensor(DType::kFloat32, {5});
    EXPECT_TRUE(s.all_fail(kArg, {"learnable_sink: heads 5 != q heads 4"}));
    s.opt.score.learnable_sink = s.tensor(DType::kFloat32, {2, 4});
    EXPECT_TRUE(s.all_fail(kArg, {"learnable_sink: ndim 2 != expected 1"}));
    s.opt.score.learnable_sink = s.tensor(DType::kFloat16, {4});
    EXPECT_TRUE(s.all_fail(kDtype, {"learnable_sink: dtype float16 must be float32"}));
    s.opt.score.learnable_sink = with_device(s.tensor(DType::kFloat32, {4}), kCuda0);
    EXPECT_TRUE(s.all_fail(kArg, {"learnable_sink: on cuda:0 but q is on cpu"}));
    s.opt.score.learnable_sink = TensorView::contiguous(s.lse.data, DType::kFloat32, {4});
    EXPECT_TRUE(s.fwd_fails(kArg, {"lse: memory overlaps input learnable_sink"}));
  });
}

TEST(Validation, SinkGradient) {
  each_mode([](Call& s) {
    s.dsink = s.output(DType::kFloat32, {4});
    EXPECT_TRUE(s.bwd_fails(kArg, {"dsink: given without a learnable_sink"}));
    s.opt.score.learnable_sink = s.tensor(DType::kFloat32, {4});
    s.dsink = s.output(DType::kFloat32, {3});
    EXPECT_TRUE(s.bwd_fails(kArg, {"dsink: heads 3 != q heads 4"}));
    s.dsink = s.output(DType::kFloat64, {4});
    EXPECT_TRUE(s.bwd_fails(kDtype, {"dsink: dtype float64 must be float32"}));
    s.dsink = TensorView::strided(s.dsink.data, DType::kFloat32, {4}, {0});
    EXPECT_TRUE(s.bwd_fails(kArg, {"dsink"}));  // broadcast: its elements alias
    s.dsink = s.opt.score.learnable_sink;
    EXPECT_TRUE(s.bwd_fails(kArg, {"dsink: memory overlaps input learnable_sink"}));
    s.dsink = TensorView::contiguous(s.dq.data, DType::kFloat32, {4});
    EXPECT_TRUE(s.bwd_fails(kArg, {"dsink", "dq"}));
  });
}

// =============================================================================================
// Varlen
// =============================================================================================
TEST(Validation, CuSeqlensMissing) {
  {
    Call s(varlen_dims());
    s.vl.cu_seqlens_k = TensorView{};
    EXPECT_TRUE(s.all_fail(kArg, {"cu_seqlens_k: missing"}));
  }
  {
    Call s(varlen_dims());
    s.vl.cu_seqlens_q = TensorView{};
    EXPECT_TRUE(s.all_fail(kArg, {"cu_seqlens_q: missing"}));
  }
}

TEST(Validation, CuSeqlensWrongLengthOrRank) {
  Call s(varlen_dims());
  s.vl.cu_seqlens_k = s.ints({0, 4, 9, 9});
  EXPECT_TRUE(s.all_fail(kArg, {"cu_seqlens_k: length 4 != cu_seqlens_q length 3"}));
  s.vl.cu_seqlens_k = s.ints({0, 9});
  EXPECT_TRUE(s.all_fail(kArg, {"cu_seqlens_k: length 2 != cu_seqlens_q length 3"}));
  s.vl.cu_seqlens_q = s.ints({});
  EXPECT_TRUE(s.all_fail(kArg, {"cu_seqlens_q: needs batch + 1 >= 1 entries, has 0"}));
  s.vl.cu_seqlens_q = TensorView::contiguous(s.vl.cu_seqlens_k.data, DType::kInt32, {1, 2});
  EXPECT_TRUE(s.all_fail(kArg, {"cu_seqlens_q: ndim 2 != expected 1"}));
}

TEST(Validation, IntVectorsMustBeContiguous) {
  Call s(varlen_dims());
  const TensorView cu = s.ints({0, 7, 2, 7, 5, 7});  // {0, 2, 5} at stride 2
  s.vl.cu_seqlens_q = TensorView::strided(cu.data, DType::kInt32, {3}, {2});
  EXPECT_TRUE(s.all_fail(kArg, {"cu_seqlens_q: must be contiguous (stride 2)"}));
  s.vl.cu_seqlens_q = s.ints({0, 2, 5});
  s.vl.seqused_k = TensorView::strided(cu.data, DType::kInt32, {2}, {2});
  EXPECT_TRUE(s.all_fail(kArg, {"seqused_k: must be contiguous (stride 2)"}));
}

TEST(Validation, CuSeqlensNotMonotone) {
  Call s(varlen_dims());
  s.vl.cu_seqlens_q = s.ints({0, 3, 2});
  EXPECT_TRUE(s.values_fail(kArg, {"cu_seqlens_q: not monotone at entry 2 (2 < 3)"}));
  s.vl.cu_seqlens_q = s.ints({0, 2, 5});
  s.vl.cu_seqlens_k = s.ints({0, 4, 3});
  EXPECT_TRUE(s.values_fail(kArg, {"cu_seqlens_k: not monotone at entry 2 (3 < 4)"}));
}

TEST(Validation, CuSeqlensFirstEntryNegative) {
  Call s(varlen_dims());
  s.vl.cu_seqlens_k = s.ints({-1, 4, 9});
  EXPECT_TRUE(s.values_fail(kArg, {"cu_seqlens_k: entry 0 is -1 < 0"}));
  s.vl.cu_seqlens_k = s.ints({0, 4, 9});
  s.vl.cu_seqlens_q = s.ints({-2, 0, 3});
  EXPECT_TRUE(s.values_fail(kArg, {"cu_seqlens_q: entry 0 is -2 < 0"}));
}

TEST(Validation, CuSeqlensLastEntryPastTheEnd) {
  Call s(varlen_dims());  // total_q 6, total_k 9
  s.vl.max_seqlen_k = 6;
  s.vl.cu_seqlens_k = s.ints({0, 4, 10});
  EXPECT_TRUE(s.values_fail(kArg, {"cu_seqlens_k: last entry 10 is past the end of the tensor (9 tokens)"}));
  s.vl.cu_seqlens_k = s.ints({0, 4, 9});
  s.vl.max_seqlen_q = 5;
  s.vl.cu_seqlens_q = s.ints({0, 2, 7});
  EXPECT_TRUE(s.values_fail(kArg, {"cu_seqlens_q: last entry 7 is past the end of the tensor (6 tokens)"}));
}

TEST(Validation, MaxSeqlenSmallerThanASequence) {
  Call s(varlen_dims());  // lens_q {2, 3}, lens_k {4, 5}
  s.vl.max_seqlen_q = 2;
  EXPECT_TRUE(s.values_fail(kArg, {"max_seqlen_q: 2 < length 3 of sequence 1"}));
  s.vl.max_seqlen_q = 3;
  s.vl.max_seqlen_k = 3;
  EXPECT_TRUE(s.values_fail(kArg, {"max_seqlen_k: 3 < length 4 of sequence 0"}));
}

// Host tensors are checked on the host whatever index_check asks (kDevice only moves the check of
// device tensors); a value outside the enum is an error of its own.
TEST(Validation, VarlenIndexCheck) {
  Call s(varlen_dims());
  s.vl.index_check = flashattn::IndexCheck::kDevice;
  s.vl.cu_seqlens_q = s.ints({0, 3, 2});
  EXPECT_TRUE(s.values_fail(kArg, {"cu_seqlens_q: not monotone at entry 2 (2 < 3)"}));
  s.vl.cu_seqlens_q = s.ints({0, 2, 5});
  s.vl.index_check = static_cast<flashattn::IndexCheck>(7);
  EXPECT_TRUE(s.all_fail(kArg, {"index_check: 7 is neither kHost nor kDevice"}));
}

TEST(Validation, MaxSeqlenNegative) {
  Call s(varlen_dims());
  s.vl.max_seqlen_q = -1;
  EXPECT_TRUE(s.all_fail(kArg, {"max_seqlen_q: must be >= 0"}));
  s.vl.max_seqlen_q = 3;
  s.vl.max_seqlen_k = -7;
  EXPECT_TRUE(s.all_fail(kArg, {"max_seqlen_k: must be >= 0"}));
}

TEST(Validation, SequsedK) {
  Call s(varlen_dims());  // lens_k {4, 5}
  s.vl.seqused_k = s.ints({4, 5, 0});
  EXPECT_TRUE(s.all_fail(kArg, {"seqused_k: length 3 != batch 2"}));
  s.vl.seqused_k = s.ints({-1, 5});
  EXPECT_TRUE(s.values_fail(kArg, {"seqused_k: entry 0 is -1, outside [0, 4]"}));
  s.vl.seqused_k = s.ints({4, 6});
  EXPECT_TRUE(s.values_fail(kArg, {"seqused_k: entry 1 is 6, outside [0, 5]"}));
}

TEST(Validation, LseMissingInBackward) {
  each_mode([](Call& s) {
    s.lse = TensorView{};
    EXPECT_TRUE(s.bwd_fails(kArg, {"lse: required by the backward pass"}));
  });
}

// =============================================================================================
// Overlap
// =============================================================================================
TEST(Validation, OutAliasesQ) {
  each_mode([](Call& s) {
    s.out = s.q;
    EXPECT_TRUE(s.fwd_fails(kArg, {"out: memory overlaps input q"}));
  });
  each_mode([](Call& s) {  // partial overlap of two contiguous views
    const int64_t n = numel(s.q);
    const TensorView buf = s.tensor(DType::kFloat32, {2 * n});
    TensorView qv = s.q, ov = s.out;
    qv.data = buf.data;
    ov.data = static_cast<float*>(buf.data) + n / 2;
    s.q = qv;
    s.out = ov;
    EXPECT_TRUE(s.fwd_fails(kArg, {"out: memory overlaps input q"}));
  });
}

TEST(Validation, OutAliasesInterleavedQExactly) {
  each_mode([](Call& s) {  // q a slice of packed qkv; out the very same view
    const int64_t rows = s.varlen() ? s.total_q : 2 * 3, hd = 4 * 8;
    const TensorView buf = s.tensor(DType::kFloat32, {rows * 3 * hd});
    auto* base = static_cast<float*>(buf.data);
    if (s.varlen()) {
      s.q = TensorView::strided(base, DType::kFloat32, {rows, 4, 8}, {3 * hd, 8, 1});
    } else {
      s.q = TensorView::strided(base, DType::kFloat32, {2, 3, 4, 8}, {9 * hd, 3 * hd, 8, 1});
    }
    s.out = s.q;
    EXPECT_TRUE(s.fwd_fails(kArg, {"out: memory overlaps input q"}));
  });
}

TEST(Validation, LseOverlapsOut) {
  each_mode([](Call& s) {
    TensorView l = s.lse;
    l.data = s.out.data;
    s.lse = l;
    EXPECT_TRUE(s.fwd_fails(kArg, {"lse: memory overlaps out (outputs must not alias)"}));
  });
}

TEST(Validation, DqAliasesDout) {
  each_mode([](Call& s) {
    s.dq = s.dout;
    EXPECT_TRUE(s.bwd_fails(kArg, {"dq: memory overlaps input dout"}));
  });
  each_mode([](Call& s) {
    s.dq = s.q;
    EXPECT_TRUE(s.bwd_fails(kArg, {"dq: memory overlaps input q"}));
  });
}

TEST(Validation, DkAliasesDv) {
  each_mode([](Call& s) {
    s.dk = s.dv;
    EXPECT_TRUE(s.bwd_fails(kArg, {"dv: memory overlaps dk (outputs must not alias)"}));
  });
}

TEST(Validation, OutputOverlapsAlibiSlopes) {
  each_mode([](Call& s) {
    s.opt.score.alibi_slopes = TensorView::contiguous(s.lse.data, DType::kFloat32, {4});
    EXPECT_TRUE(s.fwd_fails(kArg, {"lse: memory overlaps input alibi_slopes"}));
    s.opt.score.alibi_slopes = TensorView::contiguous(s.dq.data, DType::kFloat32, {4});
    EXPECT_TRUE(s.bwd_fails(kArg, {"dq: memory overlaps input alibi_slopes"}));
  });
}

TEST(Validation, OutputOverlapsCuSeqlens) {
  Call s(varlen_dims());
  const int32_t cu_q[3] = {0, 2, 5}, cu_k[3] = {0, 4, 9}, used[2] = {3, 5};
  std::memcpy(s.out.data, cu_q, sizeof cu_q);
  s.vl.cu_seqlens_q = TensorView::contiguous(s.out.data, DType::kInt32, {3});
  EXPECT_TRUE(s.fwd_fails(kArg, {"out: memory overlaps input cu_seqlens_q"}));
  s.vl.cu_seqlens_q = s.ints({0, 2, 5});
  std::memcpy(s.dk.data, cu_k, sizeof cu_k);
  s.vl.cu_seqlens_k = TensorView::contiguous(s.dk.data, DType::kInt32, {3});
  EXPECT_TRUE(s.bwd_fails(kArg, {"dk: memory overlaps input cu_seqlens_k"}));
  s.vl.cu_seqlens_k = s.ints({0, 4, 9});
  std::memcpy(s.dv.data, used, sizeof used);
  s.vl.seqused_k = TensorView::contiguous(s.dv.data, DType::kInt32, {2});
  EXPECT_TRUE(s.bwd_fails(kArg, {"dv: memory overlaps input seqused_k"}));
}

TEST(Validation, OutputOverlapsItself) {
  each_mode([](Call& s) {
    s.out.strides[1] = 0;  // dense: seqlen 3 rows on one; varlen: 4 heads on one
    EXPECT_TRUE(s.fwd_fails(kArg, {"out: stride[1] 0 of shape", "makes elements share memory"}));
  });
  each_mode([](Call& s) {
    s.lse.strides[0] = 0;
    EXPECT_TRUE(s.fwd_fails(kArg, {"lse: stride[0] 0 of shape"}));
  });
  each_mode([](Call& s) {
    s.dk.strides[s.nd() - 2] = 0;  // 2 kv heads on one
    EXPECT_TRUE(s.bwd_fails(kArg, {"dk: stride[" + std::to_string(s.nd() - 2) + "] 0 of shape"}));
  });
  // Strides that are nonzero but too small: the next row starts inside this one (the rows of
  // several heads interleaved over one head's width).
  each_mode([](Call& s) {
    const int seq = s.nd() - 3;                      // dense: the seqlen dim; varlen: the token dim
    s.out.strides[seq] = s.out.strides[s.nd() - 2];  // a row's stride = one head's width
    EXPECT_TRUE(s.fwd_fails(kArg, {"out: stride[", "makes elements share memory"}));
  });
}

// =============================================================================================
// Workspace
// =============================================================================================
TEST(Validation, WorkspaceQueriesAnswerZeroOnCpu) {
  each_mode([](Call& s) {
    EXPECT_TRUE(s.runs("fwd_ws", {}));
    EXPECT_TRUE(s.runs("bwd_ws", {}));
  });
  {
    Call s;
    EXPECT_EQ(flashattn::forward_workspace_size(s.fwd_args(), s.opt), 0u);
    EXPECT_EQ(flashattn::backward_workspace_size(s.bwd_args(), s.opt), 0u);
    flashattn::RunContext none;  // no workspace: fine when the answer is 0
    EXPECT_NO_THROW(flashattn::forward(s.fwd_args(), s.opt, none));
    alignas(64) static unsigned char scratch[256];
    flashattn::RunContext some{nullptr, scratch, sizeof scratch};  // extra workspace is ignored
    EXPECT_NO_THROW(flashattn::forward(s.fwd_args(), s.opt, some));
    EXPECT_NO_THROW(flashattn::backward(s.bwd_args(), s.opt, some));
  }
  {
    Call s(varlen_dims());
    EXPECT_EQ(flashattn::forward_varlen_workspace_size(s.fwd_args(), s.vl, s.opt), 0u);
    EXPECT_EQ(flashattn::backward_varlen_workspace_size(s.bwd_args(), s.vl, s.opt), 0u);
  }
}

}  // namespace
