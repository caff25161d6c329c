// What a draw at temperature costs per token and sequence (model/sampling.h), beside the same draw
// with every token of the vocabulary sorted first (as the definition reads, and as the sampler did
// before session 46). Two shapes of logits: "flat" (normal, sd 3: a random-weight model's, where
// nearly every token weighs in) and "peaked" (sd 3 around -5, a few hundred tokens 15-25 above:
// closer to a trained model's, where most of the vocabulary is too unlikely to matter). Prints
// one JSON object per (vocabulary, shape, parameters), and per (vocabulary, shape) what a token's
// log-probabilities cost (logprobs_top5).
//   moeline_sampling_bench [--draws N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "model/sampling.h"

namespace {

using Clock = std::chrono::steady_clock;

// The definition's draw: every token sorted best first (ties by id), weighed, walked.
int32_t sorted_every_token(const std::vector<float>& logits, double temperature, double u,
                           std::vector<int32_t>& order, std::vector<double>& weights) {
  order.resize(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  weights.resize(order.size());
  const double best = logits[order[0]];
  double total = 0.0;
  for (size_t i = 0; i < order.size(); ++i)
    total += weights[i] = std::exp((logits[order[i]] - best) / temperature);
  const double target = u * total;
  double cumulative = 0.0;
  for (size_t i = 0; i < order.size(); ++i)
    if (target < (cumulative += weights[i])) return order[i];
  return order.back();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int draws = 30;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--draws") draws = std::max(1, std::stoi(argv[i + 1]));
  struct Case {
    const char* name;
    double temperature, top_p, min_p;
    int64_t top_k;
  };
  const Case cases[] = {{"greedy", 0.0, 1.0, 0.0, 0},
                        {"t0.7", 0.7, 1.0, 0.0, 0},
                        {"t0.7_top_p0.9", 0.7, 0.9, 0.0, 0},
                        {"t1.0_min_p0.05", 1.0, 1.0, 0.05, 0},
                        {"t0.7_top_k40", 0.7, 1.0, 0.0, 40}};
  for (const int64_t vocab : {int64_t{32000}, int64_t{151669}}) {
    for (const bool peaked : {false, true}) {
      std::mt19937 random(1);
      std::normal_distribution<float> spread(peaked ? -5.0f : 0.0f, 3.0f);
      std::vector<float> logits(static_cast<size_t>(vocab));
      for (float& logit : logits) logit = spread(random);
      if (peaked)
        for (int i = 0; i < 300; ++i)
          logits[random() % logits.size()] = 15.0f + static_cast<float>(random() % 1000) / 100.0f;
      std::vector<int32_t> order;
      std::vector<double> weights;
      for (const Case& c : cases) {
        moeline::model::SamplingParams params;
        params.temperature = c.temperature;
        params.top_p = c.top_p;
        params.min_p = c.min_p;
        params.top_k = c.top_k;
        params.seed = 3;
        moeline::model::Sampler sampler(params);
        std::vector<double> us, sorted_us;
        int64_t checksum = 0;
        for (int d = 0; d < draws; ++d) {
          auto start = Clock::now();
          checksum += sampler.sample(logits.data(), vocab);
          us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
          if (c.temperature > 0.0 && c.top_k == 0 && c.top_p == 1.0 && c.min_p == 0.0) {
            start = Clock::now();
            checksum += sorted_every_token(logits, c.temperature, 0.5, order, weights);
            sorted_us.push_back(
                std::chrono::duration<double, std::micro>(Clock::now() - start).count());
          }
        }
        std::cout << "{\"vocab\":" << vocab << ",\"logits\":\"" << (peaked ? "peaked" : "flat")
                  << "\",\"params\":\"" << c.name << "\",\"draw_us\":" << median(us);
        if (!sorted_us.empty()) std::cout << ",\"every_token_sorted_us\":" << median(sorted_us);
        std::cout << ",\"checksum\":" << checksum << "}\n";
      }
      // A token's log-probability and its 5 best alternatives (what a request with logprobs
      // costs per token, and echo with logprobs per prompt token), beside the normalizer alone as
      // the definition reads it: a double exp per token, as token_logprobs took it until
      // session 49.
      std::vector<double> logprobs_us, double_exp_us;
      double checksum = 0.0;
      for (int d = 0; d < draws; ++d) {
        auto start = Clock::now();
        checksum += moeline::model::token_logprobs(logits.data(), vocab, 7, 5).logprob;
        logprobs_us.push_back(
            std::chrono::duration<double, std::micro>(Clock::now() - start).count());
        start = Clock::now();
        const double best = *std::max_element(logits.begin(), logits.end());
        double sum = 0.0;
        for (float logit : logits) sum += std::exp(static_cast<double>(logit) - best);
        checksum += std::log(sum);
        double_exp_us.push_back(
            std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      }
      std::cout << "{\"vocab\":" << vocab << ",\"logits\":\"" << (peaked ? "peaked" : "flat")
                << "\",\"params\":\"logprobs_top5\",\"logprobs_us\":" << median(logprobs_us)
                << ",\"double_exp_normalizer_us\":" << median(double_exp_us)
                << ",\"checksum\":" << checksum << "}\n";
    }
  }
}
