SchedulerPolicy = str
