#include "model/kv_cache.h"

#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <vector>

namespace moeline::model {
namespace {

TEST(BlockPool, AllocatesEveryBlockOnceThenReportsExhaustion) {
  BlockPool pool(4);
  std::set<int32_t> seen;
  for (int i = 0; i < 4; ++i) {
    auto block = pool.allocate();
    ASSERT_TRUE(block.has_value());
    EXPECT_TRUE(seen.insert(*block).second);
  }
  EXPECT_EQ(pool.free_blocks(), 0);
  EXPECT_FALSE(pool.allocate().has_value());
  pool.release(2);
  EXPECT_EQ(pool.allocate(), 2);
}

TEST(BlockPool, SharedBlockIsFreedByItsLastHolder) {
  BlockPool pool(2);
  const int32_t block = *pool.allocate();
  pool.retain(block);
  pool.release(block);
  EXPECT_EQ(pool.free_blocks(), 1);
  pool.release(block);
  EXPECT_EQ(pool.free_blocks(), 2);
}

TEST(Sequence, ReservesWholeBlocksAndRefusesWhenThePoolIsShort) {
  BlockPool pool(3);
  Sequence sequence(1, 7, 0);
  EXPECT_TRUE(sequence.reserve(pool, 17));  // 2 blocks
  EXPECT_EQ(sequence.block_table().size(), 2u);
  EXPECT_FALSE(sequence.reserve(pool, 60));  // 4 blocks: 2 more, but only 1 is free
  EXPECT_EQ(sequence.block_table().size(), 2u);
  EXPECT_EQ(pool.free_blocks(), 1);
  sequence.release(pool);
  EXPECT_EQ(pool.free_blocks(), 3);
}

// Whole blocks at exact multiples of the block size: 16 tokens take one block, 17 two, and a
// sequence that grows one token at a time takes a new block only at token 16k + 1.
TEST(Sequence, ReservesExactlyTheBlocksItsTokensFill) {
  for (int64_t tokens : {int64_t{1}, kBlockTokens - 1, kBlockTokens, kBlockTokens + 1,
                         2 * kBlockTokens, 2 * kBlockTokens + 1, 5 * kBlockTokens}) {
    BlockPool pool(8);
    Sequence sequence(1, 7, 0);
    ASSERT_TRUE(sequence.reserve(pool, tokens)) << tokens;
    EXPECT_EQ(static_cast<int64_t>(sequence.block_table().size()),
              (tokens + kBlockTokens - 1) / kBlockTokens)
        << tokens;
    EXPECT_EQ(pool.free_blocks(), 8 - static_cast<int32_t>(sequence.block_table().size()));
  }
  BlockPool pool(8);
  Sequence growing(1, 7, 0);
  std::vector<int32_t> token = {5};
  for (int64_t length = 1; length <= 3 * kBlockTokens + 1; ++length) {
    ASSERT_TRUE(growing.reserve(pool, 1));
    growing.commit(token);
    EXPECT_EQ(static_cast<int64_t>(growing.block_table().size()),
              (length + kBlockTokens - 1) / kBlockTokens)
        << "length " << length;
  }
  EXPECT_TRUE(growing.reserve(pool, 0));
  EXPECT_EQ(growing.block_table().size(), 4u);
}

// A pool filled exactly: every block in use, the next token refused, nothing allocated by the
// refusal; a release frees exactly what was held.
TEST(Sequence, FillsThePoolExactlyAndRefusesTheNextToken) {
  BlockPool pool(4);
  Sequence sequence(1, 7, 0);
  ASSERT_TRUE(sequence.reserve(pool, 4 * kBlockTokens));
  EXPECT_EQ(pool.free_blocks(), 0);
  std::vector<int32_t> tokens(static_cast<size_t>(4 * kBlockTokens), 3);
  sequence.commit(tokens);
  EXPECT_TRUE(sequence.reserve(pool, 0));
  EXPECT_FALSE(sequence.reserve(pool, 1));
  EXPECT_EQ(sequence.block_table().size(), 4u);
  Sequence other(2, 7, 0);
  EXPECT_FALSE(other.reserve(pool, 1));
  EXPECT_TRUE(other.block_table().empty());
  sequence.release(pool);
  EXPECT_EQ(pool.free_blocks(), 4);
  EXPECT_TRUE(other.reserve(pool, 4 * kBlockTokens));
  EXPECT_EQ(pool.free_blocks(), 0);
}

std::vector<int32_t> iota_tokens(int n, int start) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), start);
  return tokens;
}

TEST(Sequence, BlockKeysChainPrefixModelAndNamespace) {
  BlockPool pool(16);
  auto keys = [&](const std::vector<int32_t>& tokens, uint64_t model, uint64_t ns) {
    Sequence sequence(1, model, ns);
    EXPECT_TRUE(sequence.reserve(pool, static_cast<int64_t>(tokens.size())));
    // Committed in two pieces: keys must not depend on how tokens arrive.
    sequence.commit(std::span(tokens).first(5));
    sequence.commit(std::span(tokens).subspan(5));
    auto result = sequence.block_keys();
    sequence.release(pool);
    return result;
  };
  const auto tokens = iota_tokens(40, 100);
  const auto base = keys(tokens, 1, 2);
  ASSERT_EQ(base.size(), 2u);  // 40 tokens: two full blocks, the partial third has no key yet
  EXPECT_EQ(keys(tokens, 1, 2), base);
  EXPECT_NE(keys(tokens, 9, 2)[0], base[0]);  // another model
  EXPECT_NE(keys(tokens, 1, 3)[0], base[0]);  // another tenant namespace
  auto changed = tokens;
  changed[3] = 7;  // a change in block 0 changes block 1's key too (the chain)
  const auto other = keys(changed, 1, 2);
  EXPECT_NE(other[0], base[0]);
  EXPECT_NE(other[1], base[1]);
  auto late = tokens;
  late[20] = 7;  // a change in block 1 leaves block 0's key alone
  EXPECT_EQ(keys(late, 1, 2)[0], base[0]);
  EXPECT_NE(keys(late, 1, 2)[1], base[1]);
  EXPECT_NE(namespace_id("tenant-a"), namespace_id("tenant-b"));
}

}  // namespace
}  // namespace moeline::model
