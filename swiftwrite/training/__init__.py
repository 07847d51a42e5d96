"""Training TokenSwift heads for a model (`swiftwrite train-heads`): the training data and the fit."""
