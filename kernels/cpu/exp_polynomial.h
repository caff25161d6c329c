#pragma once
// The constants of the vectorized e^x (exp_avx512.h on 16 lanes, ops_avx2.cpp on 8): range
// reduction x = n ln2 + r with ln2 split in two (its high part exact in a float), Cephes' degree-6
// polynomial for e^r, and the limits past which the result is 0 or infinity. One set for every
// path, so the paths compute one formula.
namespace moeline::kernels::detail::exp_polynomial {

inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
inline constexpr float kLowest = -87.0f, kHighest = 88.7f;
// e^r ≈ 1 + r + r² (k[5] + k[4] r + ... + k[0] r⁵), evaluated by Horner from k[0].
inline constexpr float kCoefficients[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

}  // namespace moeline::kernels::detail::exp_polynomial
