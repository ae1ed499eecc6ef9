// Tiny header-only unit-test harness (no gtest: nothing can be downloaded).
//
//   TEST(Suite, Name) { CHECK_EQ(a, b); CHECK(cond) << "context"; ... }
//   int main() { return jax_ep_test::RunAllTests("binary_name"); }
//
// A failed CHECK records the failure and lets the test continue; a test passes
// when it recorded no failure and threw nothing. RunAllTests prints one line
// per test, writes a JUnit report to $XML_OUTPUT_FILE (Bazel's test.xml: one
// <testcase> per TEST) when that variable is set, and returns 1 on any failure.
// Optional argument filter: RunAllTests(name, argc, argv) runs only the tests
// whose "Suite.Name" contains argv[1].
#ifndef JAX_EP_TESTS_CC_CHECK_H_
#define JAX_EP_TESTS_CC_CHECK_H_

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace jax_ep_test {

struct TestCase {
  std::string suite;
  std::string name;
  std::function<void()> body;
};

inline std::vector<TestCase>& Registry() {
  static std::vector<TestCase> tests;
  return tests;
}

struct Registrar {
  Registrar(const char* suite, const char* name, std::function<void()> body) {
    Registry().push_back({suite, name, std::move(body)});
  }
};

// Failures of the test that is running.
inline std::vector<std::string>& CurrentFailures() {
  static std::vector<std::string> failures;
  return failures;
}

// Printable form of a value (integers of any width, floats exactly enough,
// bools, strings, anything streamable).
template <typename T>
std::string Show(const T& value) {
  std::ostringstream out;
  if constexpr (std::is_same_v<T, bool>) {
    out << (value ? "true" : "false");
  } else if constexpr (std::is_integral_v<T> && sizeof(T) == 1) {
    out << static_cast<int>(value);
  } else if constexpr (std::is_floating_point_v<T>) {
    out.precision(9);
    out << value;
  } else if constexpr (std::is_convertible_v<T, std::string>) {
    out << '"' << std::string(value) << '"';
  } else {
    out << value;
  }
  return out.str();
}

template <typename T>
std::string Show(const std::vector<T>& values) {
  std::string text = "{";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) text += ", ";
    text += Show(static_cast<T>(values[i]));
  }
  return text + "}";
}

// Collects the "<< context" of a failed check, records it on destruction.
class FailureMessage {
 public:
  FailureMessage(const char* file, int line, std::string what) {
    std::ostringstream out;
    out << file << ":" << line << ": " << what;
    text_ = out.str();
  }
  FailureMessage(const FailureMessage&) = delete;
  ~FailureMessage() {
    std::string text = text_;
    if (!context_.str().empty()) text += " -- " + context_.str();
    std::fprintf(stderr, "    %s\n", text.c_str());
    CurrentFailures().push_back(text);
  }
  template <typename T>
  FailureMessage& operator<<(const T& value) {
    context_ << value;
    return *this;
  }

 private:
  std::string text_;
  std::ostringstream context_;
};

// Swallows "<< context" when the check passed.
struct NoMessage {
  template <typename T>
  NoMessage& operator<<(const T&) {
    return *this;
  }
};

template <typename A, typename B>
bool Equal(const A& a, const B& b) {
  if constexpr (std::is_integral_v<A> && std::is_integral_v<B>) {
    return static_cast<long long>(a) == static_cast<long long>(b);  // no sign-compare surprises
  } else {
    return a == b;
  }
}

inline std::string XmlEscape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

inline int RunAllTests(const char* binary_name, int argc = 0, char** argv = nullptr) {
  const std::string filter = (argc > 1 && argv != nullptr) ? argv[1] : "";
  struct Outcome {
    const TestCase* test;
    std::vector<std::string> failures;
    double seconds;
  };
  std::vector<Outcome> outcomes;
  int failed = 0;
  double total_seconds = 0;
  for (const TestCase& test : Registry()) {
    const std::string full = test.suite + "." + test.name;
    if (!filter.empty() && full.find(filter) == std::string::npos) continue;
    CurrentFailures().clear();
    std::printf("[ RUN  ] %s\n", full.c_str());
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    try {
      test.body();
    } catch (const std::exception& e) {
      FailureMessage(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    } catch (...) {
      FailureMessage(__FILE__, __LINE__, "uncaught non-std exception");
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total_seconds += seconds;
    const bool ok = CurrentFailures().empty();
    if (!ok) ++failed;
    std::printf("[ %s ] %s\n", ok ? " OK " : "FAIL", full.c_str());
    outcomes.push_back({&test, CurrentFailures(), seconds});
  }
  std::printf("%s: %zu test(s), %zu passed, %d failed\n", binary_name, outcomes.size(),
              outcomes.size() - failed, failed);

  if (const char* xml_path = std::getenv("XML_OUTPUT_FILE"); xml_path && *xml_path) {
    std::ofstream xml(xml_path);
    xml << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n"
        << "<testsuite name=\"" << XmlEscape(binary_name) << "\" tests=\"" << outcomes.size()
        << "\" failures=\"" << failed << "\" errors=\"0\" skipped=\"0\" time=\""
        << total_seconds << "\">\n";
    for (const Outcome& outcome : outcomes) {
      xml << "  <testcase classname=\"" << XmlEscape(binary_name) << "." << XmlEscape(outcome.test->suite)
          << "\" name=\"" << XmlEscape(outcome.test->name) << "\" time=\"" << outcome.seconds
          << "\"";
      if (outcome.failures.empty()) {
        xml << "/>\n";
        continue;
      }
      std::string all;
      for (const std::string& f : outcome.failures) all += f + "\n";
      xml << ">\n    <failure message=\"" << XmlEscape(outcome.failures.front()) << "\">"
          << XmlEscape(all) << "</failure>\n  </testcase>\n";
    }
    xml << "</testsuite>\n</testsuites>\n";
  }
  return failed == 0 && !outcomes.empty() ? 0 : 1;
}

}  // namespace jax_ep_test

#define JAX_EP_TEST_CONCAT_INNER(a, b) a##b
#define JAX_EP_TEST_CONCAT(a, b) JAX_EP_TEST_CONCAT_INNER(a, b)

#define TEST(suite, name)                                                          \
  static void JAX_EP_TEST_CONCAT(Test_##suite##_, name)();                         \
  static ::jax_ep_test::Registrar JAX_EP_TEST_CONCAT(registrar_##suite##_, name)( \
      #suite, #name, &JAX_EP_TEST_CONCAT(Test_##suite##_, name));                  \
  static void JAX_EP_TEST_CONCAT(Test_##suite##_, name)()

// CHECK(cond) << "context";
#define CHECK(cond)                    \
  if (cond) {                          \
    ::jax_ep_test::NoMessage();        \
  } else                               \
    ::jax_ep_test::FailureMessage(__FILE__, __LINE__, "CHECK(" #cond ") failed")

#define JAX_EP_CHECK_OP(a, b, op, pred)                                                      \
  if (auto check_ab_ = std::make_pair((a), (b));                                             \
      [](const auto& check_a_, const auto& check_b_) { return pred; }(check_ab_.first,       \
                                                                       check_ab_.second)) {  \
    ::jax_ep_test::NoMessage();                                                              \
  } else                                                                                     \
    ::jax_ep_test::FailureMessage(__FILE__, __LINE__,                                        \
                                  std::string("CHECK(" #a " " op " " #b ") failed: ") +      \
                                      ::jax_ep_test::Show(check_ab_.first) + " vs " +        \
                                      ::jax_ep_test::Show(check_ab_.second))

#define CHECK_EQ(a, b) JAX_EP_CHECK_OP(a, b, "==", ::jax_ep_test::Equal(check_a_, check_b_))
#define CHECK_NE(a, b) JAX_EP_CHECK_OP(a, b, "!=", !::jax_ep_test::Equal(check_a_, check_b_))
#define CHECK_LT(a, b) JAX_EP_CHECK_OP(a, b, "<", check_a_ < check_b_)
#define CHECK_LE(a, b) JAX_EP_CHECK_OP(a, b, "<=", check_a_ <= check_b_)

// |a - b| <= tol
#define CHECK_NEAR(a, b, tol)                                                                \
  if (double check_a_ = (a), check_b_ = (b); std::fabs(check_a_ - check_b_) <= (tol)) {      \
    ::jax_ep_test::NoMessage();                                                              \
  } else                                                                                     \
    ::jax_ep_test::FailureMessage(__FILE__, __LINE__,                                        \
                                  std::string("CHECK_NEAR(" #a ", " #b ", " #tol ") failed: ") + \
                                      ::jax_ep_test::Show(check_a_) + " vs " +               \
                                      ::jax_ep_test::Show(check_b_))

// haystack contains needle (std::string).
#define CHECK_CONTAINS(haystack, needle)                                                     \
  if (std::string check_h_ = (haystack), check_n_ = (needle);                               \
      check_h_.find(check_n_) != std::string::npos) {                                        \
    ::jax_ep_test::NoMessage();                                                              \
  } else                                                                                     \
    ::jax_ep_test::FailureMessage(__FILE__, __LINE__,                                        \
                                  "CHECK_CONTAINS(" #haystack ", " #needle                   \
                                  ") failed: \"" + check_h_ + "\" lacks \"" + check_n_ + "\"")

#endif  // JAX_EP_TESTS_CC_CHECK_H_
