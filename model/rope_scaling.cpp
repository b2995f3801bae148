#include "model/rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/error.h"

namespace longtrain::model {

const std::vector<std::string>& rope_scaling_types() {
  static const std::vector<std::string> types = {"default", "linear", "dynamic", "yarn", "llama3"};
  return types;
}

void validate_rope_scaling(const RopeScaling& s) {
  const auto& types = rope_scaling_types();
  LT_CHECK(std::find(types.begin(), types.end(), s.type) != types.end(),
           "model.rope_scaling '{}' is not a RoPE scaling longtrain knows; expected one of {}", s.type,
           fmt::join(types, ", "));
  const bool is_yarn = s.type == "yarn", is_llama3 = s.type == "llama3";
  const bool needs_original = s.type == "dynamic" || is_yarn || is_llama3;

  // A field the type does not read would be silently ignored: name it instead.
  auto unused = [&](bool set, const char* field) {
    LT_CHECK(!set, "model.rope_{} is set but model.rope_scaling {} does not use it; remove it", field, s.type);
  };
  unused(s.is_default() && s.factor != 0.0, "factor");
  unused(!needs_original && s.original_max_position_embeddings != 0, "original_max_position_embeddings");
  unused(!is_llama3 && s.low_freq_factor != 0.0, "low_freq_factor");
  unused(!is_llama3 && s.high_freq_factor != 0.0, "high_freq_factor");
  unused(!is_yarn && s.beta_fast != 0.0, "beta_fast");
  unused(!is_yarn && s.beta_slow != 0.0, "beta_slow");
  unused(!is_yarn && s.attention_factor != 0.0, "attention_factor");
  unused(!is_yarn && s.mscale != 0.0, "mscale");
  unused(!is_yarn && s.mscale_all_dim != 0.0, "mscale_all_dim");
  unused(!is_yarn && !s.truncate, "truncate");
  if (s.is_default()) return;

  LT_CHECK(s.factor != 0.0, "model.rope_scaling {} needs model.rope_factor (the context extension ratio, e.g. 8)",
           s.type);
  LT_CHECK(std::isfinite(s.factor) && s.factor >= 1.0, "model.rope_factor must be >= 1 for rope_scaling {}, got {}",
           s.type, s.factor);
  if (needs_original)
    LT_CHECK(s.original_max_position_embeddings > 0,
             "model.rope_scaling {} needs model.rope_original_max_position_embeddings (the context length the model "
             "was pretrained at), got {}",
             s.type, s.original_max_position_embeddings);
  if (is_llama3) {
    LT_CHECK(s.low_freq_factor > 0.0, "model.rope_scaling llama3 needs model.rope_low_freq_factor > 0 (Llama 3.1: 1)");
    LT_CHECK(s.high_freq_factor > 0.0, "model.rope_scaling llama3 needs model.rope_high_freq_factor > 0 (Llama 3.1: 4)");
    LT_CHECK(s.high_freq_factor > s.low_freq_factor,
             "model.rope_high_freq_factor ({}) must be above model.rope_low_freq_factor ({}) for rope_scaling llama3",
             s.high_freq_factor, s.low_freq_factor);
  }
  if (is_yarn) {
    const std::pair<double, const char*> fields[] = {{s.beta_fast, "beta_fast"},
                                                     {s.beta_slow, "beta_slow"},
                                                     {s.attention_factor, "attention_factor"},
                                                     {s.mscale, "mscale"},
                                                     {s.mscale_all_dim, "mscale_all_dim"}};
    for (const auto& [v, field] : fields)
      LT_CHECK(std::isfinite(v) && v >= 0.0, "model.rope_{} must be >= 0 (0 = not given), got {}", field, v);
  }
}

namespace {

// yarn's magnitude correction: 0.1·k·ln s + 1 for s > 1.
double yarn_mscale(double scale, double k) { return scale <= 1.0 ? 1.0 : 0.1 * k * std::log(scale) + 1.0; }

}  // namespace

RopeTable rope_table(const RopeScaling& s, double theta, int64_t head_dim, int64_t seq_len) {
  validate_rope_scaling(s);
  LT_CHECK(head_dim > 0 && head_dim % 2 == 0, "RoPE needs an even head_dim, got {}", head_dim);
  const int64_t half = head_dim / 2;
  const double D = static_cast<double>(head_dim), f = s.factor;
  const auto L0 = static_cast<double>(s.original_max_position_embeddings);
  auto plain = [&](double base) {
    std::vector<double> inv(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) inv[i] = 1.0 / std::pow(base, 2.0 * static_cast<double>(i) / D);
    return inv;
  };

  RopeTable out;
  if (s.type == "default") {
    out.inv_freq = plain(theta);
  } else if (s.type == "linear") {
    out.inv_freq = plain(theta);
    for (double& v : out.inv_freq) v /= f;
  } else if (s.type == "dynamic") {
    LT_CHECK(head_dim > 2, "model.rope_scaling dynamic needs head_dim > 2 (its exponent is D/(D-2)), got {}", head_dim);
    const double L = std::max(static_cast<double>(seq_len), L0);
    out.inv_freq = plain(theta * std::pow(f * L / L0 - (f - 1.0), D / (D - 2.0)));
  } else if (s.type == "yarn") {
    if (s.attention_factor != 0.0)
      out.attention_factor = s.attention_factor;
    else if (s.mscale != 0.0 && s.mscale_all_dim != 0.0)
      out.attention_factor = yarn_mscale(f, s.mscale) / yarn_mscale(f, s.mscale_all_dim);
    else
      out.attention_factor = yarn_mscale(f, 1.0);
    const double beta_fast = s.beta_fast != 0.0 ? s.beta_fast : 32.0;
    const double beta_slow = s.beta_slow != 0.0 ? s.beta_slow : 1.0;
    // The dimension index at which a frequency completes `rotations` turns over L0 positions.
    auto correction_dim = [&](double rotations) {
      return D * std::log(L0 / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (s.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, D - 1.0);
    if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
    const std::vector<double> extrapolated = plain(theta);
    out.inv_freq.resize(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      out.inv_freq[i] = extrapolated[i] / f * ramp + extrapolated[i] * (1.0 - ramp);
    }
  } else {  // llama3
    const double low_wavelen = L0 / s.low_freq_factor, high_wavelen = L0 / s.high_freq_factor;
    out.inv_freq = plain(theta);
    for (double& v : out.inv_freq) {
      const double wavelen = 2.0 * std::numbers::pi / v;
      if (wavelen > low_wavelen) {
        v /= f;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (L0 / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        v = (1.0 - smooth) * v / f + smooth * v;
      }
    }
  }
  return out;
}

}  // namespace longtrain::model
