// A count known only at run time (rows of x in a pass, a head dim's 32-column steps) as a compile-time constant, so a
// kernel's loops over it unroll and its accumulators stay in registers.
#pragma once

#include <cstdint>
#include <type_traits>

// fn(std::integral_constant<int, n>{}) for n in 1 .. 7, and for any other n with 8 (callers pass 1 .. 8).
template <typename Fn>
inline void with_count(int64_t n, Fn&& fn) {
  switch (n) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{});
  }
}
