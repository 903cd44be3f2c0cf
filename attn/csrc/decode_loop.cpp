// attn::decode_loop: attn.generate's decode steps, one token a row each, in one call: sample from
// the logits, record the token, embed it, run every decoder layer and the final norm
// (attn::decode_layers), then the output layer, and again.
//
// At batch 1 the kernels of a step read the weights at about the machine's read bandwidth, and the
// Python around them (the forward's checks and plan, the mask, sampling, the loop's bookkeeping)
// cost 1.1-1.3 ms of a 10-12 ms step (SmolLM2-135M shape, bf16, 2 threads, AMD EPYC Zen 4): each
// of its few dozen objects is cold after the weights stream through the caches. Here a step's work
// between the kernels is a few loops over b rows and the same ATen calls attn/generation.py's
// sampler makes, in its order (the same tokens and log-probabilities, bit for bit, and the same
// draws from the generator).
//
// The caller (attn/native_loop.py) decides that the model's steps are exactly this: every layer
// one attn::decode_layers run with the final norm, no hook anywhere, no embedding scale, no soft
// cap, no window inside the attended slots. Every input is checked before the first write.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// One token a row from (b, v) logits, and its log-probability: attn.generation._sample's ATen
// calls, in its order. scaled and probs (b, v) fp32, cumulative (b, v) fp64: written in place.
std::pair<at::Tensor, at::Tensor> sample(const at::Tensor& logits, double temperature, int64_t top_k,
                                         const c10::optional<at::Generator>& generator, at::Tensor& scaled,
                                         at::Tensor& probs, at::Tensor& cumulative) {
  // fp32 at temperature 0: read as they are; else an fp32 copy, divided by the temperature (a
  // division by the fp32 scalar, as torch.div(logits, t, out=...) and div_ are).
  at::Tensor x = logits.scalar_type() == at::kFloat && temperature == 0.0 ? logits : scaled.copy_(logits);
  if (temperature != 0.0) x.div_(temperature);
  at::Tensor tokens;  // (b,)
  if (temperature == 0.0) {
    tokens = attn::first_argmax(x);  // x.max(-1)'s indices, in a tenth of the time (first_argmax.cpp)
  } else {
    if (top_k > 0 && top_k <= attn::kKeepTopKMost) {
      attn::keep_top_k(x, top_k);  // as the two ATen calls below leave x, faster (top_k.cpp)
    } else if (top_k > 0) {
      const at::Tensor kth = std::get<0>(x.topk(top_k, -1)).narrow(1, top_k - 1, 1);  // (b, 1)
      x.masked_fill_(x < kth, -std::numeric_limits<double>::infinity());
    }
    at::softmax_out(probs, x, -1);
    attn::running_sums(probs, cumulative);  // at::cumsum_out(cumulative, probs, -1, at::kDouble)'s sums, faster
    const at::Tensor draw = at::rand({x.size(0), 1}, generator, x.options().dtype(at::kDouble));  // (b, 1)
    tokens = at::searchsorted(cumulative, draw * cumulative.narrow(1, x.size(1) - 1, 1), false, true);
    tokens = tokens.clamp_max_(x.size(1) - 1).squeeze(-1);
  }
  const at::Tensor logprobs = at::log_softmax_out(probs, x, -1);  // (b, v)
  return {tokens.contiguous(), logprobs};
}

}  // namespace

namespace attn {

// Runs decode steps [first_step, last_step) of a generation of `new_tokens.size(1)` tokens; returns
// how many ran the model: last_step - first_step where the generation goes on, fewer where it ended
// (its last step samples and stops, as does a step after which every row stopped).
// logits (b, v): the next step's, read, and replaced by the last model step's. key_valid (b, n):
// the slots that hold real tokens (attn.generation._decode's); next_pos (b, 1): the next token's
// positions; done (b,) bool: rows that stopped; fill: the cache state's, advanced a step at a time.
int64_t decode_loop(const at::Tensor& logits, const at::Tensor& embedding, const at::Tensor& head,
                    at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
                    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& final_norm, double final_eps,
                    double eps, double scale, int64_t amx_from_rows, const at::Tensor& cos_sin,
                    const at::Tensor& key_valid, const at::Tensor& next_pos, const at::Tensor& fill,
                    const at::Tensor& done, const at::Tensor& new_tokens, const at::Tensor& new_mask,
                    const at::Tensor& logprobs, const c10::optional<at::Tensor>& all_logits,
                    const at::Tensor& stop_ids, int64_t pad_id, double temperature, int64_t top_k,
                    const c10::optional<at::Generator>& generator, int64_t first_step, int64_t last_step,
                    bool avx2, int64_t group, int64_t shared) {
  const auto dtype = embedding.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == dtype && logits.is_contiguous() && logits.device().is_cpu(),
              "attn::decode_loop: logits must be a contiguous (b, v) CPU tensor of the embedding's dtype ", dtype,
              ", got ", logits.sizes(), " ", logits.scalar_type());
  const int64_t b = logits.size(0), v = logits.size(1);
  TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous() && embedding.device().is_cpu() &&
                  head.dim() == 2 && head.is_contiguous() && head.scalar_type() == dtype &&
                  head.size(0) == v && head.size(1) == embedding.size(1),
              "attn::decode_loop: the embedding (V, e) and the output layer's weight (v, e) must be contiguous CPU "
              "tensors of one dtype with v = the logits' ", v, ", got ", embedding.sizes(), " ", dtype, " and ",
              head.sizes(), " ", head.scalar_type());
  const int64_t e = embedding.size(1), N = new_tokens.size(1), n = key_valid.size(1);
  const int64_t d = cos_sin.size(-1);
  TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.size(0) == 2 && cos_sin.scalar_type() == at::kFloat &&
                  cos_sin.is_contiguous(),
              "attn::decode_loop: cos_sin must be the contiguous fp32 (2, positions, d) RoPE table, got ",
              cos_sin.sizes(), " ", cos_sin.scalar_type());
  const auto rows_of = [&](const at::Tensor& t, at::ScalarType type, int64_t width) {
    return t.dim() == 2 && t.size(0) == b && t.size(1) == width && t.scalar_type() == type && t.is_contiguous() &&
           t.device().is_cpu();
  };
  TORCH_CHECK(rows_of(key_valid, at::kBool, n) && rows_of(next_pos, at::kLong, 1) &&
                  rows_of(new_tokens, at::kLong, N) && rows_of(new_mask, at::kBool, N) &&
                  rows_of(logprobs, at::kFloat, N) && done.numel() == b && done.scalar_type() == at::kBool &&
                  done.is_contiguous() && fill.numel() == 1 && fill.scalar_type() == at::kLong,
              "attn::decode_loop: key_valid (", b, ", n) bool, next_pos (", b, ", 1) long, new_tokens, new_mask and "
              "logprobs (", b, ", N) long, bool and fp32, done (", b, ",) bool and a long fill, all contiguous on the "
              "CPU; got ", key_valid.sizes(), ", ", next_pos.sizes(), ", ", new_tokens.sizes(), ", ", new_mask.sizes(),
              ", ", logprobs.sizes(), ", ", done.sizes(), ", ", fill.sizes());
  TORCH_CHECK(!all_logits.has_value() || (all_logits->dim() == 3 && all_logits->size(0) == b &&
                                          all_logits->size(1) == N && all_logits->size(2) == v &&
                                          all_logits->scalar_type() == at::kFloat),
              "attn::decode_loop: all_logits must be None or (", b, ", ", N, ", ", v, ") fp32");
  TORCH_CHECK(0 <= first_step && first_step < last_step && last_step <= N, "attn::decode_loop: steps [", first_step,
              ", ", last_step, ") are not a range of the generation's ", N);
  TORCH_CHECK(0 <= pad_id && pad_id < embedding.size(0) && temperature >= 0.0 && top_k >= 0 && top_k <= v,
              "attn::decode_loop: pad_id ", pad_id, " must be an id of the embedding's ", embedding.size(0),
              " rows, temperature ", temperature, " >= 0 and top_k ", top_k, " in [0, ", v, "] (0: none)");
  TORCH_CHECK(v <= embedding.size(0), "attn::decode_loop: ", v, " logits a row, but the embedding has ",
              embedding.size(0), " rows: a token could have no embedding");
  TORCH_CHECK(stop_ids.scalar_type() == at::kLong && stop_ids.dim() == 1 && stop_ids.is_contiguous() &&
                  stop_ids.device().is_cpu() && done.device().is_cpu() && fill.device().is_cpu() &&
                  cos_sin.device().is_cpu(),
              "attn::decode_loop: stop_ids must be a 1-d long CPU tensor, and done, fill and cos_sin CPU tensors");
  TORCH_CHECK(!k_caches.empty() && k_caches[0].dim() == 4 && k_caches[0].size(3) == d && weights.size() > 0 &&
                  weights[0].dim() == 1 && weights[0].size(0) == e,
              "attn::decode_loop: the RoPE table's rows (", d, ") must be the caches' head dim and the embedding's "
              "width (", e, ") the first norm's, got caches ", k_caches.empty() ? at::IntArrayRef() : k_caches[0].sizes(),
              " and a first weight ", weights.size() > 0 ? weights[0].sizes() : at::IntArrayRef());
  int64_t* pos = next_pos.data_ptr<int64_t>();
  const int64_t first_slot = fill.data_ptr<int64_t>()[0];
  const int64_t steps = last_step - first_step;  // model steps are at most this many, each a slot and a position
  for (int64_t r = 0; r < b; ++r)
    TORCH_CHECK(0 <= pos[r] && pos[r] + steps - 1 < cos_sin.size(1), "attn::decode_loop: row ", r, " reaches position ",
                pos[r] + steps - 1, ", past the RoPE table's ", cos_sin.size(1));
  check_shared_slots("attn::decode_loop", b, group, shared);
  TORCH_CHECK(first_slot >= shared, "attn::decode_loop: the steps write slots from ", first_slot, ", inside the ",
              shared, " slots the rows share (group ", group, "): each row writes its own token there");
  TORCH_CHECK(0 <= first_slot && first_slot + steps - 1 < n, "attn::decode_loop: the steps write slots ", first_slot,
              " to ", first_slot + steps - 1, ", past the ", n, " slots attended");
  const std::vector<int64_t> stops(stop_ids.data_ptr<int64_t>(), stop_ids.data_ptr<int64_t>() + stop_ids.numel());

  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor scaled = at::empty({b, v}, f32), probs = at::empty({b, v}, f32);
  at::Tensor cumulative = at::empty({b, v}, f32.dtype(at::kDouble));
  at::Tensor slot = at::empty({1}, next_pos.options());
  at::Tensor mask = at::empty({b, 1, n}, key_valid.options());
  at::Tensor rotation = at::empty({2, b, 1, 1, d}, f32);
  at::Tensor x = at::empty({b, 1, e}, embedding.options());
  const int64_t row_bytes = e * embedding.element_size();
  at::Tensor current = logits;
  bool* finished = done.data_ptr<bool>();
  for (int64_t step = first_step; step < last_step; ++step) {
    if (all_logits.has_value()) all_logits->select(1, step).copy_(current);
    const auto drawn = sample(current, temperature, top_k, generator, scaled, probs, cumulative);
    const int64_t* token = drawn.first.data_ptr<int64_t>();
    const float* logprob = drawn.second.data_ptr<float>();
    int64_t* out_tokens = new_tokens.data_ptr<int64_t>();
    bool* out_mask = new_mask.data_ptr<bool>();
    float* out_logprobs = logprobs.data_ptr<float>();
    std::vector<int64_t> next(b);  // the tokens the rows feed the model
    bool all_done = true;
    for (int64_t r = 0; r < b; ++r) {
      const bool was_done = finished[r];
      next[r] = was_done ? pad_id : token[r];
      out_tokens[r * N + step] = next[r];
      out_logprobs[r * N + step] = was_done ? 0.0f : logprob[r * v + token[r]];
      out_mask[r * N + step] = !was_done;
      finished[r] = was_done || std::find(stops.begin(), stops.end(), next[r]) != stops.end();
      all_done = all_done && finished[r];
    }
    if (step == N - 1 || (!stops.empty() && all_done)) return step - first_step;
    // The model step: the tokens' embeddings, the layers at slot fill, the output layer.
    const int64_t at_slot = fill.data_ptr<int64_t>()[0];
    slot.data_ptr<int64_t>()[0] = at_slot;
    const bool* valid = key_valid.data_ptr<bool>();
    bool* allowed = mask.data_ptr<bool>();
    const float* table = cos_sin.data_ptr<float>();
    float* rows = rotation.data_ptr<float>();
    const int64_t positions = cos_sin.size(1);
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t j = 0; j < n; ++j) allowed[r * n + j] = (j <= at_slot && valid[r * n + j]) || j == at_slot;
      std::memcpy(rows + r * d, table + pos[r] * d, d * sizeof(float));                        // cos
      std::memcpy(rows + (b + r) * d, table + (positions + pos[r]) * d, d * sizeof(float));    // signed sin
      std::memcpy(static_cast<char*>(x.data_ptr()) + r * row_bytes,
                  static_cast<const char*>(embedding.data_ptr()) + next[r] * row_bytes, row_bytes);
    }
    const at::Tensor h = decode_layers(x, weights, biases, k_caches, v_caches, slot, mask, rotation, eps, scale,
                                       amx_from_rows, final_norm, final_eps, avx2, group,
                                       shared);  // (b, 1, e), normed
    current = layer_product(h.view({b, e}), head, amx_from_rows, avx2);  // (b, v)
    fill.add_(1);
    for (int64_t r = 0; r < b; ++r) pos[r] += 1;
  }
  logits.copy_(current);
  return last_step - first_step;
}

}  // namespace attn

TORCH_LIBRARY_IMPL(attn, CPU, m) { m.impl("decode_loop", &attn::decode_loop); }
