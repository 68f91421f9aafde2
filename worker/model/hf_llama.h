// The Hugging Face LLaMA layout of our model (transformers'
// LlamaForCausalLM): tensor names and shapes, and config.json. No LibTorch;
// thread-safe (no state).
//
// Our parameters map one to one, with no transpose or permutation: our
// projections are stored [out, in] and applied as x·Wᵀ like nn.Linear, and
// our rotary embedding is already transformers' "rotate half" form (the
// first and second halves of each head pair up), so q_proj/k_proj need none
// of the permutation that converting Meta's interleaved checkpoints needs.
// GQA repeats each key/value head for consecutive query heads in both.
//
//   embed.weight          model.embed_tokens.weight                [vocab, d]
//   layers.i.attn_norm    model.layers.i.input_layernorm.weight    [d]
//   layers.i.wq / wk      model.layers.i.self_attn.q_proj / k_proj [d | kv, d]
//   layers.i.wv / wo      model.layers.i.self_attn.v_proj / o_proj [kv | d, d]
//   layers.i.mlp_norm     model.layers.i.post_attention_layernorm  [d]
//   layers.i.w_gate/w_up  model.layers.i.mlp.gate_proj / up_proj  [ffn, d]
//   layers.i.w_down       model.layers.i.mlp.down_proj             [d, ffn]
//   norm.weight           model.norm.weight                        [d]
//   head.weight           lm_head.weight                           [vocab, d]
// (kv = num_kv_heads × head_dim; HF names carry ".weight".)
#ifndef DETOUR_WORKER_MODEL_HF_LLAMA_H_
#define DETOUR_WORKER_MODEL_HF_LLAMA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_config.h"

namespace detour::model {

struct HfParameter {
  std::string ours;  // global name in our stages and checkpoints
  std::string hf;    // transformers' name
  std::vector<int64_t> shape;
};

// Every parameter of a model of `config`, in our order (embedding, blocks,
// final norm, head).
std::vector<HfParameter> HfLlamaParameters(const ModelConfig& config);

// The HF name of one of our global parameter names; "" if it has none.
std::string HfNameOf(absl::string_view ours);

// Tensors a LLaMA checkpoint may carry that are not parameters and are
// ignored on import (older transformers saved the rotary frequencies).
bool IsIgnoredHfTensor(absl::string_view hf_name);

// What config.json says besides the shape.
struct HfConfigExtras {
  std::string torch_dtype = "float32";  // "float32" | "bfloat16"
  // "byte" (our byte tokenizer, recorded under "detour") or "sentencepiece"
  // (tokenizer.model next to it).
  std::string tokenizer = "byte";
  int64_t bos_token_id = -1;  // -1: unknown, not written
  int64_t eos_token_id = -1;
  uint64_t iteration = 0;  // of the exported checkpoint (recorded under "detour")
};

// config.json for LlamaForCausalLM with our shape (max_position_embeddings
// = context_length, tie_word_embeddings false: our head is untied).
std::string HfLlamaConfigJson(const ModelConfig& config, const HfConfigExtras& extras);

// The parts of a (possibly foreign) LLaMA config.json that import needs.
struct HfLlamaConfig {
  ModelConfig model;  // context_length = max_position_embeddings
  bool tie_word_embeddings = false;
};

// Parses config.json strictly enough that a model we would compute
// differently is refused: model_type "llama", hidden_act "silu", no
// rope_scaling, no attention or MLP biases, head_dim = hidden/heads when
// given. INVALID_ARGUMENT naming `what` and the field; bounded input.
absl::StatusOr<HfLlamaConfig> ParseHfLlamaConfig(absl::string_view json, const std::string& what);

// FAILED_PRECONDITION naming the first field of `hf` that differs from the
// job's `job` shape ("config.json hidden_size 64 vs the job's model.d_model
// 128"); the job's context may be shorter than max_position_embeddings.
absl::Status CheckHfConfigMatches(const HfLlamaConfig& hf, const ModelConfig& job,
                                  const std::string& what);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_HF_LLAMA_H_
