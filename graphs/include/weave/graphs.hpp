// weave's training: the GPT-MoE model's configuration and the table of its flags, the parallel
// plan and mesh, model shards, pipeline schedules, the TrainingStep and the Trainer (the training
// loop), checkpoints and data. See docs/api.md and docs/training_step.md.
#pragma once

#include "weave/graphs/checkpoint.hpp"
#include "weave/graphs/config_flags.hpp"
#include "weave/graphs/host_calibration.hpp"
#include "weave/graphs/learning_rate.hpp"
#include "weave/graphs/mesh.hpp"
#include "weave/graphs/model_config.hpp"
#include "weave/graphs/model_shard.hpp"
#include "weave/graphs/parallel_plan.hpp"
#include "weave/graphs/pipeline_layout.hpp"
#include "weave/graphs/pipeline_lowering.hpp"
#include "weave/graphs/pipeline_schedule.hpp"
#include "weave/graphs/pipeline_schedule_csv.hpp"
#include "weave/graphs/pipeline_schedule_generators.hpp"
#include "weave/graphs/pipeline_schedule_simulation.hpp"
#include "weave/graphs/pipeline_schedule_svg.hpp"
#include "weave/graphs/pipeline_transfers.hpp"
#include "weave/graphs/prediction.hpp"
#include "weave/graphs/token_dataset.hpp"
#include "weave/graphs/trainer.hpp"
#include "weave/graphs/trainer_config.hpp"
#include "weave/graphs/training_data.hpp"
#include "weave/graphs/training_step.hpp"
#include "weave/graphs/virtual_replay.hpp"
