#include <gtest/gtest.h>

#include "attention_case.hpp"

using fa_test::Case;
using flashattn::DType;

TEST(Smoke, ForwardBackwardFp32) {
  Case c;
  c.seqlen_q = 113;
  c.seqlen_k = 203;
  fa_test::run_case(c);
}
TEST(Smoke, Print) {
  Case c; c.seqlen_q = 113; c.seqlen_k = 203; c.dtype = DType::kBFloat16; c.causal = true; c.softcap = 50; c.alibi = true; c.dropout = 0.17f; c.heads_kv = 2;
  auto r = fa_test::run_case(c);
  printf("out %g/%g grad %g/%g\n", r.out_err, r.out_bound, r.grad_err, r.grad_bound);
  c.dtype = DType::kFloat32;
}
