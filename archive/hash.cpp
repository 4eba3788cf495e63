#include "archive/hash.hpp"

namespace sbx::archive {

ParallelSha256::ParallelSha256(size_t buffer_bytes, size_t buffers) {
  for (size_t i = 0; i < buffers; ++i) {
    bufs_.push_back(std::make_unique<std::vector<char>>(buffer_bytes));
    free_.push_back(bufs_.back().get());
  }
  thread_ = std::thread([this] { run(); });
}

ParallelSha256::~ParallelSha256() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::vector<char>& ParallelSha256::take() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return !free_.empty(); });
  auto* b = free_.back();
  free_.pop_back();
  return *b;
}

void ParallelSha256::push(std::vector<char>& b, size_t n) {
  {
    std::lock_guard lock(mu_);
    if (n == 0)
      free_.push_back(&b);
    else
      queue_.push_back({&b, n});
  }
  cv_.notify_all();
}

std::string ParallelSha256::digest() {
  std::unique_lock lock(mu_);
  queue_.push_back({nullptr, 0});
  cv_.notify_all();
  cv_.wait(lock, [this] { return digest_.has_value(); });
  return *std::exchange(digest_, std::nullopt);
}

void ParallelSha256::run() {
  auto sha = std::make_unique<Sha256>();
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;  // what is queued is dropped: its caller is gone
    Item it = queue_.front();
    queue_.pop_front();
    if (!it.buf) {
      digest_ = sha->hex();
      sha = std::make_unique<Sha256>();
      cv_.notify_all();
      continue;
    }
    lock.unlock();
    sha->update(it.buf->data(), it.n);
    lock.lock();
    free_.push_back(it.buf);
    cv_.notify_all();
  }
}

bool is_sha256_hex(std::string_view s) {
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

}  // namespace sbx::archive
