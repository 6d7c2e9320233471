// GPT-2 against PyTorch: logits, loss and every parameter gradient of a tiny model, and the
// losses of ten AdamW steps with gradient clipping (tests/reference/make_gpt2_reference.py).
#include <cmath>

#include "gpt2_test_util.h"
#include "test_util.h"
#include "training/trainer.h"

namespace tessera::testing {
namespace {

class Gpt2ReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::map<std::string, ReferenceTensor>> file =
        ReadReferenceFile(SourcePath("tests/reference/gpt2_tiny_reference.bin"));
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    ref_ = *std::move(file);
    const std::vector<int32_t>& c = ref_.at("config").ints;
    config_ = Gpt2Config{c[0], c[1], c[2], c[3], c[4]};
    plan_.batch = c[5];
    plan_.seq_len = c[6];
    const std::vector<float>& h = ref_.at("hparams").floats;
    lr_ = h[0];
    plan_.optimizer.beta1 = h[1];
    plan_.optimizer.beta2 = h[2];
    plan_.optimizer.eps = h[3];
    plan_.optimizer.weight_decay = h[4];
    plan_.optimizer.max_grad_norm = h[5];
    ExecutorOptions options;
    options.threads = 2;
    ASSERT_OK_AND_ASSIGN(trainer_, Trainer::Create(*BuildGpt2(config_), plan_, options));
    for (const std::string& name : trainer_->ParameterNames()) {
      const ReferenceTensor& value = ref_.at(name);
      ASSERT_OK(trainer_->SetParameter(name, value.floats, value.shape));
    }
  }

  std::map<std::string, ReferenceTensor> ref_;
  Gpt2Config config_;
  TrainingPlan plan_;
  float lr_ = 0;
  std::unique_ptr<Trainer> trainer_;
};

TEST_F(Gpt2ReferenceTest, LogitsMatchPyTorch) {
  ASSERT_OK_AND_ASSIGN(std::vector<float> logits,
                       Gpt2Logits(*trainer_, ref_.at("tokens").ints, plan_.batch, plan_.seq_len));
  const double error = ScaledMaxError(logits, ref_.at("logits").floats);
  std::printf("logits: max error %.2e of their scale\n", error);
  EXPECT_LE(error, 1e-4) << "logits differ from PyTorch by " << error << " of their scale";
}

TEST_F(Gpt2ReferenceTest, LossAndEveryGradientMatchPyTorch) {
  ASSERT_OK(trainer_->SetKeepGradients(true));
  ASSERT_OK_AND_ASSIGN(StepReport step,
                       Gpt2Step(*trainer_, ref_.at("tokens").ints, ref_.at("targets").ints, lr_));
  const float expected_loss = ref_.at("loss").floats[0];
  EXPECT_NEAR(step.loss, expected_loss, 1e-5 * expected_loss);
  int checked = 0;
  double worst = 0;
  for (const std::string& name : trainer_->ParameterNames()) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> grad, trainer_->GetGradient(name));
    const double error = ScaledMaxError(grad, ref_.at("grad." + name).floats);
    worst = std::max(worst, error);
    EXPECT_LE(error, 1e-4) << "gradient of " << name << " differs by " << error << " of its scale";
    ++checked;
  }
  EXPECT_EQ(checked, 2 + 12 * config_.layers + 2);
  std::printf("loss %.7f vs %.7f; worst gradient error %.2e of its scale over %d tensors\n",
              step.loss, expected_loss, worst, checked);
}

TEST_F(Gpt2ReferenceTest, TenAdamWStepsFollowPyTorchLosses) {
  // PyTorch in fp32, and the same steps in fp64 (the exact answer's proxy).
  const std::vector<float>& expected = ref_.at("losses").floats;
  const std::vector<float>& exact = ref_.at("losses_f64").floats;
  ASSERT_EQ(expected.size(), 10u);
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(StepReport step,
                         Gpt2Step(*trainer_, ref_.at("tokens").ints, ref_.at("targets").ints, lr_));
    EXPECT_NEAR(step.loss, expected[i], 1e-5 * std::abs(expected[i])) << "step " << i + 1;
    EXPECT_NEAR(step.loss, exact[i], 1e-5 * std::abs(exact[i])) << "step " << i + 1;
    worst = std::max(worst, std::abs(static_cast<double>(step.loss) - expected[i]) /
                                std::abs(static_cast<double>(expected[i])));
  }
  std::printf("10 AdamW steps: worst relative loss difference from PyTorch %.2e\n", worst);
}

}  // namespace
}  // namespace tessera::testing
