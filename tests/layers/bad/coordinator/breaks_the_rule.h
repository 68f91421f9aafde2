#include "worker/model/stage.h"
