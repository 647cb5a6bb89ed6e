RunnerOption = str
