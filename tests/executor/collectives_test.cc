// The collective layer on real gloo process groups: forked processes, one per rank, meeting
// through a file store. Each result is checked against what the ranks' inputs imply.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

#include "moeplan/executor/calibration/calibrate.h"
#include "moeplan/executor/model/context_attention.h"
#include "moeplan/executor/model/sharded_model.h"
#include "moeplan/executor/ranks/collectives.h"
#include "moeplan/executor/ranks/mesh.h"
#include "moeplan/executor/ranks/runtime.h"
#include "moeplan/executor/training/parallel_trainer.h"
#include "run_fixture.h"
#include "test_support.h"

namespace moeplan::executor {
namespace {

using namespace std::chrono_literals;

// Thrown in a rank when a result is wrong; the rank then exits with 1.
struct Mismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void check_equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  if (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type() || !torch::equal(got, want))
    throw Mismatch(what + ": got " + c10::str(got) + " want " + c10::str(want));
}

// Runs body(rank, store) in `ranks` forked processes meeting through one file store. Returns
// each rank's exit code (0 ok, 1 mismatch, 2 collective error, 3 other, -1 killed or hung).
using Store = c10::intrusive_ptr<c10d::Store>;
std::vector<int> run_ranks_on_store(int ranks, const std::function<void(int, const Store&)>& body) {
  test::TempDir dir;
  const std::string store_path = dir.file("store");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < ranks; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int code = 0;
      ignore_broken_pipes();
      try {
        const Store store = c10::make_intrusive<c10d::FileStore>(store_path, ranks);
        body(rank, store);
      } catch (const Mismatch& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        code = 1;
      } catch (const CollectiveError& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        code = 2;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
        code = 3;
      }
      std::fflush(stderr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(static_cast<size_t>(ranks), -1);
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  for (int rank = 0; rank < ranks; ++rank) {
    int status = 0;
    while (::waitpid(pids[rank], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pids[rank], SIGKILL);
        ::waitpid(pids[rank], &status, 0);
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    if (WIFEXITED(status)) codes[rank] = WEXITSTATUS(status);
  }
  return codes;
}

// Runs body(rank, communicator) on a gloo group of `ranks` forked processes.
std::vector<int> run_ranks(int ranks, const std::function<void(int, Communicator&)>& body,
                           std::chrono::milliseconds timeout = 20s) {
  return run_ranks_on_store(ranks, [&](int rank, const Store& store) {
    Communicator comm(make_gloo_group(store, "world", rank, ranks, timeout), "test group");
    body(rank, comm);
  });
}

void expect_all_ok(const std::vector<int>& codes) {
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// Rank r's test data: distinct values per rank, row and column.
torch::Tensor rank_rows(int rank, int64_t rows, int64_t cols, torch::ScalarType type = torch::kFloat) {
  return (torch::arange(rows * cols, torch::kFloat).view({rows, cols}) + 100.0 * rank).to(type);
}

// The fit in the cost model's terms: on 2 ranks an all-gather counts 1 step of latency and half
// its output bytes.
TEST(FitCollective, RecoversLatencyAndBandwidthOfTheCostModel) {
  executor::CollectiveSweep sweep;
  sweep.name = "all_gather";
  for (double bytes : {1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22}) {
    sweep.bytes.push_back(bytes);
    sweep.seconds.push_back(2e-4 + 0.5 * bytes / 1e9);
  }
  const CollectiveFit f = executor::fit_collective(sweep, 2);
  EXPECT_NEAR(f.latency_s, 2e-4, 1e-9);
  EXPECT_NEAR(f.bandwidth_bytes_per_s, 1e9, 1e3);
}

// A sweep whose times fall with the size (a transport that handled its small and middle sizes
// worse than its largest) still gives a fit: a profile without one loses its measured points.
TEST(FitCollective, TimesThatFallWithSizeStillGiveABandwidth) {
  executor::CollectiveSweep sweep;
  sweep.name = "all_gather";
  sweep.bytes = {1 << 14, 1 << 18, 1 << 20, 1 << 22};
  sweep.seconds = {4e-3, 3e-3, 2e-3, 1e-3};
  const CollectiveFit f = executor::fit_collective(sweep, 2);
  EXPECT_TRUE(f.given());
  EXPECT_NEAR(f.latency_s, 4e-3, 1e-12);                           // the smallest message
  EXPECT_NEAR(f.bandwidth_bytes_per_s, 0.5 * (1 << 22) / 1e-3, 1);  // the largest one's rate
}

TEST(Collectives, AllReduceSumsOverRanks) {
  expect_all_ok(run_ranks(4, [](int rank, Communicator& comm) {
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      torch::Tensor t = rank_rows(rank, 3, 5, type);
      comm.all_reduce_sum(t);
      // sum over r of (x + 100 r) = 4x + 600
      check_equal(t, (torch::arange(15, torch::kFloat).view({3, 5}) * 4 + 600).to(type), "all-reduce");
    }
  }));
}

// A process group of one runs its backend's collectives (what tests of a backend on one device
// rely on): every result is the rank's own data, and every call went through the backend (the
// observer hears of each; a null group's copies are not observed).
TEST(Collectives, AProcessGroupOfOneRunsItsBackend) {
  expect_all_ok(run_ranks(1, [](int, Communicator& comm) {
    int64_t observed = 0;
    comm.set_observer([&observed](const char*, int64_t, auto, auto) { ++observed; });
    const torch::Tensor want = rank_rows(0, 3, 5);
    torch::Tensor t = want.clone();
    comm.all_reduce_sum(t);
    check_equal(t, want, "all-reduce");
    check_equal(comm.all_gather(want), want, "all-gather");
    check_equal(comm.reduce_scatter_sum(want), want, "reduce-scatter");
    check_equal(comm.all_to_all(want, {3}, {3}), want, "all-to-all");
    comm.broadcast(t, 0);
    check_equal(t, want, "broadcast");
    if (observed != 5) throw Mismatch(std::to_string(observed) + " collectives observed, 5 called");
  }));
}

TEST(Collectives, AllGatherConcatenatesInRankOrder) {
  expect_all_ok(run_ranks(3, [](int rank, Communicator& comm) {
    for (const auto type : {torch::kFloat, torch::kBFloat16, torch::kLong}) {
      const torch::Tensor got = comm.all_gather(rank_rows(rank, 2, 4, type));
      check_equal(got, torch::cat({rank_rows(0, 2, 4, type), rank_rows(1, 2, 4, type), rank_rows(2, 2, 4, type)}),
                  "all-gather");
    }
  }));
}

// Two gathers in flight while the rank does other work (here another collective on the same
// group), finished later: each lands whole and in rank order.
TEST(Collectives, StartedAllGathersFinishWithTheirOwnData) {
  expect_all_ok(run_ranks(3, [](int rank, Communicator& comm) {
    Communicator::PendingGather first = comm.start_all_gather(rank_rows(rank, 2, 4, torch::kFloat));
    Communicator::PendingGather second = comm.start_all_gather(rank_rows(10 + rank, 3, 4, torch::kBFloat16));
    torch::Tensor sum = torch::full({5}, static_cast<float>(rank + 1));
    comm.all_reduce_sum(sum);
    check_equal(sum, torch::full({5}, 6.0f), "all-reduce between the gathers");
    check_equal(comm.finish_all_gather(first),
                torch::cat({rank_rows(0, 2, 4, torch::kFloat), rank_rows(1, 2, 4, torch::kFloat),
                            rank_rows(2, 2, 4, torch::kFloat)}),
                "first gather");
    check_equal(comm.finish_all_gather(second),
                torch::cat({rank_rows(10, 3, 4, torch::kBFloat16), rank_rows(11, 3, 4, torch::kBFloat16),
                            rank_rows(12, 3, 4, torch::kBFloat16)}),
                "second gather");
  }));
}

TEST(Collectives, ReduceScatterGivesEachRankItsSummedChunk) {
  expect_all_ok(run_ranks(4, [](int rank, Communicator& comm) {
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      const torch::Tensor full = rank_rows(rank, 8, 3, type);  // 4 chunks of 2 rows
      const torch::Tensor got = comm.reduce_scatter_sum(full);
      torch::Tensor want = torch::zeros({2, 3});
      for (int r = 0; r < 4; ++r) want += rank_rows(r, 8, 3).narrow(0, 2 * rank, 2);
      check_equal(got, want.to(type), "reduce-scatter");
    }
  }));
}

// Two reduce-scatters in flight (fp32 and bf16) while the rank does other work, finished later in
// the order started: each rank its own summed chunk, in the input's type.
TEST(Collectives, StartedReduceScattersFinishWithTheirOwnSums) {
  expect_all_ok(run_ranks(3, [](int rank, Communicator& comm) {
    Communicator::PendingScatter first = comm.start_reduce_scatter_sum(rank_rows(rank, 6, 2, torch::kFloat));
    Communicator::PendingScatter second = comm.start_reduce_scatter_sum(rank_rows(rank, 3, 4, torch::kBFloat16));
    torch::Tensor sum = torch::full({5}, static_cast<float>(rank + 1));
    comm.all_reduce_sum(sum);
    check_equal(sum, torch::full({5}, 6.0f), "all-reduce between the scatters");
    torch::Tensor want_first = torch::zeros({2, 2}), want_second = torch::zeros({1, 4});
    for (int r = 0; r < 3; ++r) {
      want_first += rank_rows(r, 6, 2).narrow(0, 2 * rank, 2);
      want_second += rank_rows(r, 3, 4, torch::kBFloat16).to(torch::kFloat).narrow(0, rank, 1);
    }
    check_equal(comm.finish_reduce_scatter(first), want_first, "first scatter");
    check_equal(comm.finish_reduce_scatter(second), want_second.to(torch::kBFloat16), "second scatter");
  }));
}

// bf16 parts are summed in fp32 and rounded once: 1 + 3 x 2^-8 is 1.01171875, which bf16 rounds
// to 1.015625, while adding the parts in bf16 one at a time to the 1 never leaves 1 (each
// 2^-8 is half of bf16's spacing there and rounds away). The same for all-reduce.
TEST(Collectives, Bf16SumsAreRoundedOnce) {
  expect_all_ok(run_ranks(4, [](int rank, Communicator& comm) {
    const float part = rank == 0 ? 1.0f : 1.0f / 256.0f;
    const torch::Tensor want = torch::full({1, 2}, 1.01171875f).to(torch::kBFloat16);
    const torch::Tensor full = torch::full({4, 2}, part).to(torch::kBFloat16);
    check_equal(comm.reduce_scatter_sum(full), want, "reduce-scatter");
    torch::Tensor t = torch::full({1, 2}, part).to(torch::kBFloat16);
    comm.all_reduce_sum(t);
    check_equal(t, want, "all-reduce");
  }));
}

TEST(Collectives, AllToAllWithUnevenSplits) {
  // Rank s sends (s + d) % 3 rows to rank d: some pairs exchange nothing.
  expect_all_ok(run_ranks(3, [](int rank, Communicator& comm) {
    const int n = 3;
    auto rows = [](int from, int to) { return static_cast<int64_t>((from + to) % n); };
    std::vector<int64_t> send, recv;
    for (int d = 0; d < n; ++d) send.push_back(rows(rank, d));
    for (int s = 0; s < n; ++s) recv.push_back(rows(s, rank));
    // Row j sent from s to d holds the value 100 s + 10 d + j.
    std::vector<torch::Tensor> pieces;
    for (int d = 0; d < n; ++d)
      pieces.push_back(torch::arange(rows(rank, d), torch::kFloat).unsqueeze(1).expand({-1, 2}) + 100.0 * rank + 10.0 * d);
    const torch::Tensor got = comm.all_to_all(torch::cat(pieces), send, recv);
    std::vector<torch::Tensor> want;
    for (int s = 0; s < n; ++s)
      want.push_back(torch::arange(rows(s, rank), torch::kFloat).unsqueeze(1).expand({-1, 2}) + 100.0 * s + 10.0 * rank);
    check_equal(got, torch::cat(want).contiguous(), "all-to-all");
    // bf16 through the same path.
    const torch::Tensor got16 = comm.all_to_all(torch::cat(pieces).to(torch::kBFloat16), send, recv);
    check_equal(got16, torch::cat(want).to(torch::kBFloat16), "all-to-all bf16");
  }));
}

TEST(Collectives, BroadcastFromRoot) {
  expect_all_ok(run_ranks(3, [](int rank, Communicator& comm) {
    torch::Tensor t = rank_rows(rank, 2, 2, torch::kBFloat16);
    comm.broadcast(t, 2);
    check_equal(t, rank_rows(2, 2, 2, torch::kBFloat16), "broadcast");
  }));
}

// Values no fp16 holds (3e38, 1e-30): bf16 arrives bit for bit, never converted on the way.
torch::Tensor extreme_bf16() {
  return torch::tensor({3e38f, -1e-30f, 1.0f / 3.0f, 0.0f, -2.5f, 65504.0f}).view({2, 3}).to(torch::kBFloat16);
}

// fp32 and bf16 from rank 0 to rank 1 and back changed; a transposed (non-contiguous) tensor
// arrives in its logical order; the observer sees each transfer with its bytes.
TEST(PointToPoint, RoundTripsFloatAndBf16BetweenTwoRanks) {
  expect_all_ok(run_ranks(2, [](int rank, Communicator& comm) {
    std::vector<std::pair<std::string, int64_t>> seen;
    comm.set_observer([&](const char* op, int64_t bytes, auto, auto) { seen.emplace_back(op, bytes); });
    const torch::Tensor f = rank_rows(0, 3, 4);
    const torch::Tensor b = extreme_bf16();
    const torch::Tensor transposed = rank_rows(0, 4, 2).t();
    if (rank == 0) {
      comm.send(f, 1);
      comm.send(b, 1);
      comm.send(transposed, 1);
      check_equal(comm.recv({3, 4}, torch::kFloat, 1), f + 1, "fp32 back");
      check_equal(comm.recv({2, 3}, torch::kBFloat16, 1), -b, "bf16 back");
      const std::vector<std::pair<std::string, int64_t>> want = {
          {"send", 48}, {"send", 12}, {"send", 32}, {"recv", 48}, {"recv", 12}};
      if (seen != want) throw Mismatch("observer saw " + std::to_string(seen.size()) + " transfers, not as sent");
    } else {
      const torch::Tensor got_f = comm.recv({3, 4}, torch::kFloat, 0);
      const torch::Tensor got_b = comm.recv({2, 3}, torch::kBFloat16, 0);
      check_equal(got_f, f, "fp32");
      check_equal(got_b, b, "bf16");
      check_equal(comm.recv({2, 4}, torch::kFloat, 0), transposed.contiguous(), "transposed");
      comm.send(got_f + 1, 0);
      comm.send(-got_b, 0);
    }
  }));
}

// Rank 0's tensor goes 0 -> 1 -> 2 -> 0, each rank adding 10 x its rank on the way: fp32, then
// bf16 (values below 64, whose sums stay exact).
TEST(PointToPoint, PassesATensorAroundARingOfThree) {
  expect_all_ok(run_ranks(3, [](int rank, Communicator& comm) {
    const int next = (rank + 1) % 3, previous = (rank + 2) % 3;
    for (const auto type : {torch::kFloat, torch::kBFloat16}) {
      const torch::Tensor start = rank_rows(0, 2, 5, type);
      if (rank == 0) {
        comm.send(start, next);
        check_equal(comm.recv({2, 5}, type, previous), (start.to(torch::kFloat) + 30).to(type), "around the ring");
      } else {
        const torch::Tensor got = comm.recv({2, 5}, type, previous);
        check_equal(got, (start.to(torch::kFloat) + (rank == 1 ? 0 : 10)).to(type), "on the way");
        comm.send((got.to(torch::kFloat) + 10.0 * rank).to(type), next);
      }
    }
  }));
}

// Both ranks send to each other at once, on two tags, and post their receives in the other
// order: started transfers neither deadlock (a blocking gloo send waits for the peer's
// receive) nor mix the two streams up.
TEST(PointToPoint, StartedTransfersBothWaysKeepTheirTags) {
  expect_all_ok(run_ranks(2, [](int rank, Communicator& comm) {
    const int peer = 1 - rank;
    auto activations = [](int r) { return rank_rows(r, 2, 3); };
    auto gradients = [](int r) { return rank_rows(10 + r, 2, 3, torch::kBFloat16); };
    Communicator::PendingTransfer send_a = comm.start_send(activations(rank), peer, 0);
    Communicator::PendingTransfer send_g = comm.start_send(gradients(rank), peer, 1);
    Communicator::PendingTransfer recv_g = comm.start_recv({2, 3}, torch::kBFloat16, peer, 1);
    Communicator::PendingTransfer recv_a = comm.start_recv({2, 3}, torch::kFloat, peer, 0);
    check_equal(comm.finish_transfer(recv_a), activations(peer), "activations");
    check_equal(comm.finish_transfer(recv_g), gradients(peer), "gradients");
    if (comm.finish_transfer(send_a).defined() || comm.finish_transfer(send_g).defined())
      throw Mismatch("a finished send returned a tensor");
  }));
}

// The peer is alive but never sends: the receive ends within the timeout (2 s here) with a
// CollectiveError naming the operation, the peer, the group and the rank.
TEST(PointToPoint, ARecvFromASilentPeerIsAnErrorWithinTheTimeout) {
  const std::vector<int> codes = run_ranks(
      2,
      [](int rank, Communicator& comm) {
        comm.barrier();  // both ranks are connected
        if (rank == 1) {
          std::this_thread::sleep_for(4s);  // alive past rank 0's timeout, sending nothing
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          comm.recv({4}, torch::kFloat, 1);
        } catch (const CollectiveError& e) {
          const auto waited = std::chrono::steady_clock::now() - start;
          const std::string what = e.what();
          for (const std::string part : {"recv from rank 1", "test group", "(rank 0 of 2)"})
            if (what.find(part) == std::string::npos) throw Mismatch("error without '" + part + "': " + what);
          if (waited < 1s || waited > 5s)
            throw Mismatch("failed after " + std::to_string(std::chrono::duration<double>(waited).count()) + " s");
          throw;
        }
        throw Mismatch("recv returned without a sender");
      },
      2s);
  EXPECT_EQ(codes[0], 2) << "rank 0 must end with a CollectiveError";
  EXPECT_EQ(codes[1], 0);
}

// Transfers need a peer: in a group of one, or to this rank itself, they are bugs.
TEST(PointToPoint, NoPeerIsALogicError) {
  Communicator alone;
  try {
    alone.send(torch::ones({2}), 0);
    ADD_FAILURE() << "send in a group of one";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("group of one"), std::string::npos) << e.what();
  }
  EXPECT_THROW(alone.recv({2}, torch::kFloat, 0), std::logic_error);
  EXPECT_THROW(alone.start_recv({2}, torch::kFloat, 0), std::logic_error);
  expect_all_ok(run_ranks(2, [](int rank, Communicator& comm) {
    for (const int64_t peer : {int64_t{rank}, int64_t{2}, int64_t{-1}}) {
      try {
        comm.send(torch::ones({2}), peer);
        throw Mismatch("send to rank " + std::to_string(peer) + " accepted");
      } catch (const std::logic_error&) {
      }
    }
  }));
}

TEST(Collectives, CheckerCatchesAWrongResult) {
  // The harness can fail: a rank expecting the wrong sum exits with 1.
  const std::vector<int> codes = run_ranks(2, [](int rank, Communicator& comm) {
    torch::Tensor t = torch::ones({2});
    comm.all_reduce_sum(t);
    check_equal(t, torch::full({2}, rank == 0 ? 2.0f : 3.0f), "all-reduce");
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 1);
}

TEST(Collectives, ADeadPeerIsAnErrorNamingTheOperationNotAHang) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int> codes = run_ranks(
      2,
      [](int rank, Communicator& comm) {
        comm.barrier();  // both ranks are connected
        if (rank == 1) ::_exit(0);  // dies without joining the all-reduce
        torch::Tensor t = torch::ones({1024});
        comm.all_reduce_sum(t);
      },
      5s);
  EXPECT_EQ(codes[0], 2) << "rank 0 must end with a CollectiveError";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
}

}  // namespace
}  // namespace moeplan::executor

namespace moeplan::executor {
namespace {

// Context-parallel attention on 3 ranks, each holding chunks r and 5 - r of a 48-token sequence:
// for both exchanges, with grouped-query heads and with and without a sliding window, each rank's
// output and its tokens' gradients of q, k and v are those of one rank attending to the whole
// sequence (the keys' gradients gathered back to the rank that holds them).
TEST(ContextAttention, EveryRanksPartIsTheWholeSequencesAttention) {
  expect_all_ok(run_ranks(3, [](int rank, Communicator& comm) {
    constexpr int64_t kSeq = 48;
    torch::manual_seed(7);
    const torch::Tensor q = torch::randn({2, 4, kSeq, 8}), k = torch::randn({2, 2, kSeq, 8}),
                        v = torch::randn({2, 2, kSeq, 8}), up = torch::randn({2, 4, kSeq, 8});
    for (const std::optional<int64_t> window : {std::optional<int64_t>(), std::optional<int64_t>(11)}) {
      // The whole sequence on this rank alone, in fp32 arithmetic of its own.
      const torch::Tensor wq = q.clone().requires_grad_(true), wk = k.clone().requires_grad_(true),
                          wv = v.clone().requires_grad_(true);
      const torch::Tensor i = torch::arange(kSeq).unsqueeze(1), j = torch::arange(kSeq).unsqueeze(0);
      torch::Tensor hidden = j > i;
      if (window) hidden = hidden | (i - j >= *window);
      const torch::Tensor scores = torch::matmul(wq, wk.repeat_interleave(2, 1).transpose(-1, -2)) / std::sqrt(8.0);
      const torch::Tensor whole =
          torch::matmul(torch::softmax(scores.masked_fill(hidden, -INFINITY), -1), wv.repeat_interleave(2, 1));
      (whole * up).sum().backward();
      for (const ContextExchange exchange : {ContextExchange::kRing, ContextExchange::kAllGather}) {
        ContextAttention attention(comm, exchange, kSeq, window);
        const torch::Tensor at = attention.positions();
        auto mine = [&at](const torch::Tensor& t) { return t.index_select(2, at).detach().clone(); };
        const torch::Tensor lq = mine(q).requires_grad_(true), lk = mine(k).requires_grad_(true),
                            lv = mine(v).requires_grad_(true);
        const torch::Tensor out = attention.attend(lq, lk, lv);
        (out * mine(up)).sum().backward();
        const std::string what = std::string(exchange == ContextExchange::kRing ? "p2p" : "all_gather") +
                                 (window ? " with a window" : "") + ": ";
        auto expect_close = [&](const torch::Tensor& got, const torch::Tensor& want, const std::string& name) {
          if (!torch::allclose(got, want, 1e-5, 1e-5))
            throw Mismatch(what + name + " differs by " + std::to_string((got - want).abs().max().item<double>()));
        };
        expect_close(out, mine(whole), "output");
        expect_close(lq.grad(), mine(wq.grad()), "q's gradient");
        expect_close(lk.grad(), mine(wk.grad()), "k's gradient");
        expect_close(lv.grad(), mine(wv.grad()), "v's gradient");
      }
    }
    // Every rank holds two chunks, and together they hold each position once.
    torch::Tensor all = comm.all_gather(context_positions(kSeq, 3, rank));
    check_equal(std::get<0>(torch::sort(all)), torch::arange(kSeq), "positions");
  }));
}


// The gradient reduce-scatters left in flight while backward goes on (as GPU ranks run them) and
// finished when the backward pass ends give bitwise the losses and weights of scatters finished
// one by one: hybrid shard over 2 ranks, fp32 and mixed precision, two steps of two micro-batches.
// That they were in flight shows in the trace: a scatter still running when the next started.
TEST(ShardedModel, GradientScattersLeftInFlightChangeNothing) {
  for (const Precision precision : {Precision::kFp32, Precision::kMixed}) {
    expect_all_ok(run_ranks_on_store(2, [precision](int rank, const Store& store) {
      Plan plan = test::tiny_plan(precision);
      plan.training.seq_len = 32;
      plan.parallel.micro_batch_size = 1;
      plan.parallel.world_size = 2;
      plan.parallel.hybrid_shard_degree = 2;
      DeviceMesh mesh(plan.parallel, rank, store, 20s);
      ShardedTrainer one_by_one(plan, mesh, nullptr), in_flight(plan, mesh, nullptr);
      in_flight.model().set_scatters_in_flight(1);
      torch::manual_seed(11 + rank);
      for (int step = 0; step < 2; ++step) {
        std::vector<torch::Tensor> batches;
        for (int m = 0; m < 2; ++m) batches.push_back(torch::randint(plan.model.vocab_size, {1, 32}, torch::kLong));
        const StepRecord a = one_by_one.step(batches), b = in_flight.step(batches);
        if (a.loss != b.loss || a.grad_norm != b.grad_norm)
          throw Mismatch("step " + std::to_string(step) + ": loss " + std::to_string(a.loss) + " vs " +
                         std::to_string(b.loss) + ", gradient norm " + std::to_string(a.grad_norm) + " vs " +
                         std::to_string(b.grad_norm));
      }
      for (size_t u = 0; u < one_by_one.model().shards().size(); ++u)
        check_equal(in_flight.model().shards()[u], one_by_one.model().shards()[u], "shard " + std::to_string(u));
      // The in-flight trainer's step (its constructor took the mesh's observers): scatters overlap.
      std::vector<const TraceEvent*> scatters;
      for (const TraceEvent& e : in_flight.clock().events())
        if (e.category == "reduce_scatter") scatters.push_back(&e);
      bool overlapped = false;
      for (size_t i = 1; i < scatters.size(); ++i)
        overlapped |= scatters[i]->start_ns < scatters[i - 1]->start_ns + scatters[i - 1]->duration_ns;
      if (scatters.size() < 2 || !overlapped)
        throw Mismatch(std::to_string(scatters.size()) + " reduce-scatters in the trace, none still running when the next started");
      // Each with the part its finish waited for, inside it.
      size_t waits = 0;
      for (const TraceEvent& e : in_flight.clock().events())
        if (e.category == "reduce_scatter_wait") {
          const bool inside = std::any_of(scatters.begin(), scatters.end(), [&e](const TraceEvent* s) {
            return e.start_ns >= s->start_ns && e.start_ns + e.duration_ns <= s->start_ns + s->duration_ns;
          });
          if (!inside) throw Mismatch("a reduce-scatter's wait outside every reduce-scatter");
          ++waits;
        }
      if (waits != scatters.size())
        throw Mismatch(std::to_string(waits) + " waits for " + std::to_string(scatters.size()) + " reduce-scatters");
    }));
  }
}

}  // namespace
}  // namespace moeplan::executor
